//! FP8 against the OCP OFP8 v1.0 value tables: every pattern decoded, every midpoint rounded.

use super::*;

// The two tables below were generated from the OCP OFP8 v1.0 definitions (Table 1 and §5.3),
// independently of the crate, by this Python:
//   def e4m3(c): e=c>>3; m=c&7
//       return None if (e,m)==(15,7) else (m*2**-9 if e==0 else (1+m/8)*2**(e-7))
//   def e5m2(c): e=c>>2; m=c&3
//       return ('inf' if m==0 else None) if e==31 else (m*2**-16 if e==0 else (1+m/4)*2**(e-15))
// (None = NaN.)
/// Positive E4M3 values by code 0x00..=0x7F (negative codes are 0x80 | code).
const E4M3_POSITIVE: [f64; 128] = [
    0.0,
    0.001953125,
    0.00390625,
    0.005859375,
    0.0078125,
    0.009765625,
    0.01171875,
    0.013671875,
    0.015625,
    0.017578125,
    0.01953125,
    0.021484375,
    0.0234375,
    0.025390625,
    0.02734375,
    0.029296875,
    0.03125,
    0.03515625,
    0.0390625,
    0.04296875,
    0.046875,
    0.05078125,
    0.0546875,
    0.05859375,
    0.0625,
    0.0703125,
    0.078125,
    0.0859375,
    0.09375,
    0.1015625,
    0.109375,
    0.1171875,
    0.125,
    0.140625,
    0.15625,
    0.171875,
    0.1875,
    0.203125,
    0.21875,
    0.234375,
    0.25,
    0.28125,
    0.3125,
    0.34375,
    0.375,
    0.40625,
    0.4375,
    0.46875,
    0.5,
    0.5625,
    0.625,
    0.6875,
    0.75,
    0.8125,
    0.875,
    0.9375,
    1.0,
    1.125,
    1.25,
    1.375,
    1.5,
    1.625,
    1.75,
    1.875,
    2.0,
    2.25,
    2.5,
    2.75,
    3.0,
    3.25,
    3.5,
    3.75,
    4.0,
    4.5,
    5.0,
    5.5,
    6.0,
    6.5,
    7.0,
    7.5,
    8.0,
    9.0,
    10.0,
    11.0,
    12.0,
    13.0,
    14.0,
    15.0,
    16.0,
    18.0,
    20.0,
    22.0,
    24.0,
    26.0,
    28.0,
    30.0,
    32.0,
    36.0,
    40.0,
    44.0,
    48.0,
    52.0,
    56.0,
    60.0,
    64.0,
    72.0,
    80.0,
    88.0,
    96.0,
    104.0,
    112.0,
    120.0,
    128.0,
    144.0,
    160.0,
    176.0,
    192.0,
    208.0,
    224.0,
    240.0,
    256.0,
    288.0,
    320.0,
    352.0,
    384.0,
    416.0,
    448.0,
    f64::NAN,
];

/// Positive E5M2 values by code 0x00..=0x7F (negative codes are 0x80 | code).
const E5M2_POSITIVE: [f64; 128] = [
    0.0,
    1.52587890625e-05,
    3.0517578125e-05,
    4.57763671875e-05,
    6.103515625e-05,
    7.62939453125e-05,
    9.1552734375e-05,
    0.0001068115234375,
    0.0001220703125,
    0.000152587890625,
    0.00018310546875,
    0.000213623046875,
    0.000244140625,
    0.00030517578125,
    0.0003662109375,
    0.00042724609375,
    0.00048828125,
    0.0006103515625,
    0.000732421875,
    0.0008544921875,
    0.0009765625,
    0.001220703125,
    0.00146484375,
    0.001708984375,
    0.001953125,
    0.00244140625,
    0.0029296875,
    0.00341796875,
    0.00390625,
    0.0048828125,
    0.005859375,
    0.0068359375,
    0.0078125,
    0.009765625,
    0.01171875,
    0.013671875,
    0.015625,
    0.01953125,
    0.0234375,
    0.02734375,
    0.03125,
    0.0390625,
    0.046875,
    0.0546875,
    0.0625,
    0.078125,
    0.09375,
    0.109375,
    0.125,
    0.15625,
    0.1875,
    0.21875,
    0.25,
    0.3125,
    0.375,
    0.4375,
    0.5,
    0.625,
    0.75,
    0.875,
    1.0,
    1.25,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    3.5,
    4.0,
    5.0,
    6.0,
    7.0,
    8.0,
    10.0,
    12.0,
    14.0,
    16.0,
    20.0,
    24.0,
    28.0,
    32.0,
    40.0,
    48.0,
    56.0,
    64.0,
    80.0,
    96.0,
    112.0,
    128.0,
    160.0,
    192.0,
    224.0,
    256.0,
    320.0,
    384.0,
    448.0,
    512.0,
    640.0,
    768.0,
    896.0,
    1024.0,
    1280.0,
    1536.0,
    1792.0,
    2048.0,
    2560.0,
    3072.0,
    3584.0,
    4096.0,
    5120.0,
    6144.0,
    7168.0,
    8192.0,
    10240.0,
    12288.0,
    14336.0,
    16384.0,
    20480.0,
    24576.0,
    28672.0,
    32768.0,
    40960.0,
    49152.0,
    57344.0,
    f64::INFINITY,
    f64::NAN,
    f64::NAN,
    f64::NAN,
];

#[test]
fn fp8_decode_matches_ocp_tables() {
    for (f, table) in [
        (Format::E4M3, &E4M3_POSITIVE),
        (Format::E5M2, &E5M2_POSITIVE),
    ] {
        for code in 0..128u64 {
            let expected = table[code as usize];
            let pos = f.decode(code).unwrap();
            let neg = f.decode(code | 0x80).unwrap();
            assert!(
                same_bits_or_nan(pos, expected),
                "{f} {code:#x}: {pos} vs {expected}"
            );
            assert!(same_bits_or_nan(neg, -expected), "{f} {:#x}", code | 0x80);
        }
    }
    assert_eq!(Format::E4M3.max_finite(), 448.0);
    assert_eq!(Format::E5M2.max_finite(), 57344.0);
    assert_eq!(Format::E4M3.min_subnormal(), E4M3_POSITIVE[1]);
    assert_eq!(Format::E5M2.min_subnormal(), E5M2_POSITIVE[1]);
    assert_eq!(Format::E4M3.min_normal(), E4M3_POSITIVE[8]);
    assert_eq!(Format::E5M2.min_normal(), E5M2_POSITIVE[4]);
}

/// OCP rounding written from the table alone: nearest table value, ties to the even code;
/// the next grid value past max (480 for E4M3, 2^16 for E5M2) stands for "overflow".
fn table_round(table: &[f64; 128], beyond_max: f64, x: f64, saturate: bool, has_inf: bool) -> f64 {
    let a = x.abs();
    let mut candidates: Vec<(f64, usize)> = table
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (v, i))
        .collect();
    let max_code = candidates.last().unwrap().1;
    candidates.push((beyond_max, max_code + 1));
    let mut best = candidates[0];
    for &(v, code) in &candidates[1..] {
        let (d_new, d_best) = ((v - a).abs(), (best.0 - a).abs());
        if d_new < d_best || (d_new == d_best && code % 2 == 0) {
            best = (v, code);
        }
    }
    let v = if best.1 > max_code {
        if saturate {
            candidates[candidates.len() - 2].0
        } else if has_inf {
            f64::INFINITY
        } else {
            f64::NAN
        }
    } else {
        best.0
    };
    if x < 0.0 {
        -v
    } else {
        v
    }
}

#[test]
fn fp8_rounding_matches_ocp_tables_on_every_midpoint() {
    for (f, table, beyond, has_inf) in [
        (Format::E4M3, &E4M3_POSITIVE, 480.0, false),
        (Format::E5M2, &E5M2_POSITIVE, 65536.0, true),
    ] {
        let mut grid: Vec<f64> = table.iter().copied().filter(|v| v.is_finite()).collect();
        grid.push(beyond);
        let mut points = vec![];
        for w in grid.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for x in [w[0], mid, w[1]] {
                points.extend([x, x * (1.0 + 1e-12), x * (1.0 - 1e-12)]);
            }
        }
        points.extend([beyond * 1.5, 1e6, 1e-30, f64::MIN_POSITIVE]);
        for &x in &points {
            for s in [x, -x] {
                for sat in [false, true] {
                    let ov = if sat {
                        Overflow::Saturating
                    } else {
                        Overflow::NonSaturating
                    };
                    let ours = f.round(s, ov);
                    let theirs = table_round(table, beyond, s, sat, has_inf);
                    assert!(
                        same_bits_or_nan(ours, theirs) || (ours == 0.0 && theirs == 0.0),
                        "{f} round({s:e}, {ov:?}) = {ours} but the table says {theirs}"
                    );
                }
            }
        }
    }
}
