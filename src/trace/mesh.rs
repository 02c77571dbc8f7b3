//! The device mesh: named axes of any number, outermost first.
//!
//! A [`Mesh`] is a list of named [`Axis`] sizes, outermost first, like a PyTorch `DeviceMesh`
//! with `mesh_dim_names`. Global rank `r` is the row-major index of its coordinates: for axes
//! of sizes `n₀, n₁, …, n_k` and coordinates `(c₀, c₁, …, c_k)`,
//! `r = (…(c₀·n₁ + c₁)·n₂ + …)·n_k + c_k`, so the innermost axis's groups are contiguous ranks.
//! Megatron-LM's default order is `[dp, cp, tp]` (`r = (d·cp + c)·tp + t`), which is what
//! version 1 of the trace format could say ([`Mesh::megatron`]); a version-2 trace names its
//! axes (`pp`, `dp_shard`, `ep`, …). An axis the mesh does not name has size 1: every rank
//! has coordinate 0 along it.
//!
//! How a tensor lies on the mesh is a [`Layout`](crate::trace::Layout): one placement per
//! named axis.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::limits;

/// The name of a mesh axis: 1 to 32 bytes of lowercase ASCII letters, digits and `_`,
/// starting with a letter (`dp`, `dp_shard`, `pp`, `ep`). The conventional axes are constants.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Axis(Cow<'static, str>);

impl Axis {
    /// Data parallel (`dp`): the batch split across replicas of the model.
    pub const DP: Axis = Axis(Cow::Borrowed("dp"));
    /// Context parallel (`cp`): the sequence split for attention.
    pub const CP: Axis = Axis(Cow::Borrowed("cp"));
    /// Tensor parallel (`tp`): weight matrices split within a layer.
    pub const TP: Axis = Axis(Cow::Borrowed("tp"));
    /// Pipeline parallel (`pp`): layers placed on stages.
    pub const PP: Axis = Axis(Cow::Borrowed("pp"));
    /// Expert parallel (`ep`): the experts of a mixture split across ranks.
    pub const EP: Axis = Axis(Cow::Borrowed("ep"));

    /// The axes of a version-1 trace, outermost first: `dp`, `cp`, `tp`.
    pub const MEGATRON: [Axis; 3] = [Axis::DP, Axis::CP, Axis::TP];

    /// The axis called `name`, or [`Error::InvalidParameter`] when it is not a valid name.
    pub fn new(name: &str) -> Result<Axis> {
        let valid = (1..=limits::AXIS_NAME_BYTES).contains(&name.len())
            && name.as_bytes()[0].is_ascii_lowercase()
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !valid {
            return Err(Error::InvalidParameter {
                name: "axis",
                reason: format!(
                    "'{}' is not a mesh axis name (1 to {} bytes of a-z, 0-9 and _, starting \
                     with a letter)",
                    name.escape_default(),
                    limits::AXIS_NAME_BYTES
                ),
            });
        }
        Ok(match name {
            "dp" => Axis::DP,
            "cp" => Axis::CP,
            "tp" => Axis::TP,
            "pp" => Axis::PP,
            "ep" => Axis::EP,
            _ => Axis(Cow::Owned(name.to_string())),
        })
    }

    /// The axis called `name`, if it is a valid name.
    pub fn named(name: &str) -> Option<Axis> {
        Axis::new(name).ok()
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Axis {
    type Err = Error;
    fn from_str(s: &str) -> Result<Axis> {
        Axis::new(s)
    }
}

impl Serialize for Axis {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Axis {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Axis, D::Error> {
        let name = Cow::<'de, str>::deserialize(d)?;
        Axis::new(&name).map_err(serde::de::Error::custom)
    }
}

/// A device mesh: named axes with their sizes, outermost first, and whether sequence
/// parallelism splits the regions outside tensor parallelism along the sequence across the
/// `tp` axis (informational for a checker: the layouts say where every tensor lies).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Mesh {
    axes: Vec<(Axis, usize)>,
    sp: bool,
}

/// The largest mesh accepted (2^20 ranks): far beyond any training run, small enough that
/// rank arithmetic cannot overflow.
pub const MAX_WORLD: usize = crate::limits::RANKS;

impl Mesh {
    /// A mesh of named axes, outermost first: every size at least 1, no name twice, at most
    /// [`limits::MESH_AXES`](crate::io::limits::MESH_AXES) axes and
    /// [`limits::RANKS`](crate::io::limits::RANKS) ranks; no sequence parallelism
    /// ([`Mesh::with_sequence_parallel`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use ttrace::trace::{Axis, Mesh};
    /// let mesh = Mesh::new([(Axis::PP, 2), (Axis::DP, 2), (Axis::TP, 4)])?;
    /// assert_eq!(mesh.world(), 16);
    /// assert_eq!(mesh.coord(13, &Axis::DP), 1); // 13 = (1·2 + 1)·4 + 1
    /// assert_eq!(mesh.size(&Axis::CP), 1);      // an axis it does not name
    /// # Ok::<(), ttrace::Error>(())
    /// ```
    pub fn new(axes: impl IntoIterator<Item = (Axis, usize)>) -> Result<Mesh> {
        let axes: Vec<(Axis, usize)> = axes.into_iter().collect();
        if axes.len() > limits::MESH_AXES {
            return Err(Error::InvalidParameter {
                name: "mesh",
                reason: format!(
                    "{} axes (at most {} are accepted)",
                    axes.len(),
                    limits::MESH_AXES
                ),
            });
        }
        let mut world = 1usize;
        for (i, (axis, size)) in axes.iter().enumerate() {
            if axes[..i].iter().any(|(a, _)| a == axis) {
                return Err(Error::InvalidParameter {
                    name: "mesh",
                    reason: format!("axis '{axis}' is named twice"),
                });
            }
            if *size == 0 {
                return Err(Error::InvalidParameter {
                    name: "mesh",
                    reason: format!("axis '{axis}' must have at least one rank (got 0)"),
                });
            }
            world = world
                .checked_mul(*size)
                .filter(|&w| w <= MAX_WORLD)
                .ok_or_else(|| Error::InvalidParameter {
                    name: "mesh",
                    reason: format!(
                        "{} ranks exceeds {MAX_WORLD} (a corrupted manifest?)",
                        axes.iter()
                            .map(|(a, n)| format!("{a} {n}"))
                            .collect::<Vec<_>>()
                            .join(" × ")
                    ),
                })?;
        }
        Ok(Mesh { axes, sp: false })
    }

    /// Megatron-LM's mesh, the only one a version-1 trace could describe: axes `dp`, `cp`,
    /// `tp`, outermost first (`r = (d·cp + c)·tp + t`), with sequence parallelism on or off.
    pub fn megatron(tp: usize, cp: usize, dp: usize, sp: bool) -> Result<Mesh> {
        Ok(Mesh::new([(Axis::DP, dp), (Axis::CP, cp), (Axis::TP, tp)])?.with_sequence_parallel(sp))
    }

    /// This mesh with sequence parallelism (over `tp`) on or off.
    pub fn with_sequence_parallel(mut self, sp: bool) -> Mesh {
        self.sp = sp;
        self
    }

    /// The single-device mesh of a version-1 trace: `dp`, `cp` and `tp` of size 1.
    pub fn single() -> Mesh {
        Mesh {
            axes: Axis::MEGATRON.into_iter().map(|a| (a, 1)).collect(),
            sp: false,
        }
    }

    /// The axes and their sizes, outermost first.
    pub fn axes(&self) -> &[(Axis, usize)] {
        &self.axes
    }

    /// Whether the mesh names `axis`.
    pub fn has(&self, axis: &Axis) -> bool {
        self.axes.iter().any(|(a, _)| a == axis)
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.axes.iter().map(|(_, n)| n).product()
    }

    /// Size of an axis (1 for an axis the mesh does not name).
    pub fn size(&self, axis: &Axis) -> usize {
        self.axes
            .iter()
            .find(|(a, _)| a == axis)
            .map_or(1, |&(_, n)| n)
    }

    /// A rank's coordinate along `axis` (0 for an axis the mesh does not name).
    pub fn coord(&self, rank: usize, axis: &Axis) -> usize {
        let mut stride = 1;
        for (a, n) in self.axes.iter().rev() {
            if a == axis {
                return (rank / stride) % n;
            }
            stride *= n;
        }
        0
    }

    /// A rank's coordinates, one per axis, outermost first (`rank < world`).
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        let mut out = vec![0; self.axes.len()];
        let mut r = rank;
        for (k, (_, n)) in self.axes.iter().enumerate().rev() {
            out[k] = r % n;
            r /= n;
        }
        out
    }

    /// The global rank of coordinates given per axis, outermost first.
    pub fn rank(&self, coords: &[usize]) -> usize {
        self.axes
            .iter()
            .zip(coords)
            .fold(0, |r, ((_, n), &c)| r * n + c)
    }

    /// The global rank with coordinate `c` along each named axis of `at` and 0 along the
    /// others.
    pub fn rank_at(&self, at: &[(&Axis, usize)]) -> usize {
        self.axes.iter().fold(0, |r, (a, n)| {
            r * n + at.iter().find(|(b, _)| *b == a).map_or(0, |&(_, c)| c)
        })
    }

    /// Whether sequence parallelism is in effect (SP with more than one TP rank).
    pub fn sequence_parallel(&self) -> bool {
        self.sp && self.size(&Axis::TP) > 1
    }

    /// Whether the trace declared sequence parallelism (whatever the TP size).
    pub fn sp(&self) -> bool {
        self.sp
    }

    /// Whether the axes are Megatron's `[dp, cp, tp]`, in that order: all a version-1 trace
    /// could describe.
    pub fn is_megatron(&self) -> bool {
        self.axes.len() == 3
            && self
                .axes
                .iter()
                .zip(&Axis::MEGATRON)
                .all(|((a, _), b)| a == b)
    }

    /// Short label: `tp4-sp-cp2-dp2` for Megatron's `[dp, cp, tp]` mesh (as version 1 wrote
    /// it), else the axes outermost first (`pp2-dp2-tp4-sp`).
    pub fn label(&self) -> String {
        let sp = if self.sp { "-sp" } else { "" };
        if self.is_megatron() {
            let s = |a: &Axis| self.size(a);
            return format!(
                "tp{}{sp}-cp{}-dp{}",
                s(&Axis::TP),
                s(&Axis::CP),
                s(&Axis::DP)
            );
        }
        if self.axes.is_empty() {
            return "single".into();
        }
        self.axes
            .iter()
            .map(|(a, n)| format!("{a}{n}{}", if *a == Axis::TP { sp } else { "" }))
            .collect::<Vec<_>>()
            .join("-")
    }
}

/// One axis as the manifest writes it.
#[derive(Serialize, Deserialize)]
struct NamedSize {
    name: Axis,
    size: u64,
}

/// The mesh as a manifest writes it: version 2's named axes, or version 1's three sizes. A
/// field it does not know is refused, not ignored: it may be an axis (`"pp": 2`), and an axis
/// left out changes every rank's coordinates.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MeshRepr {
    #[serde(default)]
    axes: Option<Vec<NamedSize>>,
    #[serde(default)]
    tp: Option<u64>,
    #[serde(default)]
    cp: Option<u64>,
    #[serde(default)]
    dp: Option<u64>,
    #[serde(default)]
    sp: Option<bool>,
}

impl Serialize for Mesh {
    /// Megatron's `[dp, cp, tp]` mesh in its short form, `{"tp", "cp", "dp", "sp"}` (what
    /// version 1 wrote: tools that edit such manifests keep working); any other mesh as
    /// `{"axes": [{"name", "size"}, …], "sp"}`.
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Short {
            tp: u64,
            cp: u64,
            dp: u64,
            sp: bool,
        }
        #[derive(Serialize)]
        struct Out<'a> {
            axes: Vec<NamedSize>,
            sp: &'a bool,
        }
        if self.is_megatron() {
            let n = |a: &Axis| self.size(a) as u64;
            return Short {
                tp: n(&Axis::TP),
                cp: n(&Axis::CP),
                dp: n(&Axis::DP),
                sp: self.sp,
            }
            .serialize(s);
        }
        Out {
            axes: self
                .axes
                .iter()
                .map(|(a, n)| NamedSize {
                    name: a.clone(),
                    size: *n as u64,
                })
                .collect(),
            sp: &self.sp,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Mesh {
    /// Version 2's `{"axes": [{"name": "dp", "size": 2}, …], "sp": false}` or version 1's
    /// `{"tp": 2, "cp": 1, "dp": 1, "sp": false}` (Megatron's `[dp, cp, tp]`), validated as
    /// [`Mesh::new`] validates.
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Mesh, D::Error> {
        use serde::de::Error as _;
        let r = MeshRepr::deserialize(d)?;
        let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let axes: Vec<(Axis, usize)> =
            match (r.axes, r.tp, r.cp, r.dp) {
                (Some(axes), None, None, None) => {
                    axes.into_iter().map(|a| (a.name, size(a.size))).collect()
                }
                (None, Some(tp), Some(cp), Some(dp)) => vec![
                    (Axis::DP, size(dp)),
                    (Axis::CP, size(cp)),
                    (Axis::TP, size(tp)),
                ],
                (None, ..) => {
                    return Err(D::Error::custom(
                        "a mesh is {\"axes\": [{\"name\", \"size\"}, …]} or (version 1) \
                     {\"tp\", \"cp\", \"dp\"}; fields are missing",
                    ))
                }
                (Some(_), ..) => return Err(D::Error::custom(
                    "a mesh names its axes in \"axes\" or (version 1) in \"tp\", \"cp\", \"dp\", \
                     not both",
                )),
            };
        Ok(Mesh::new(axes)
            .map_err(D::Error::custom)?
            .with_sequence_parallel(r.sp.unwrap_or(false)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_coordinates_round_trip() {
        let m = Mesh::megatron(4, 2, 2, true).unwrap();
        for r in 0..m.world() {
            assert_eq!(m.rank(&m.coords(r)), r);
            let named: Vec<(&Axis, usize)> =
                Axis::MEGATRON.iter().map(|a| (a, m.coord(r, a))).collect();
            assert_eq!(m.rank_at(&named), r);
        }
        // Version 1's formula: r = (d·cp + c)·tp + t.
        assert_eq!(m.coords(5), vec![0, 1, 1]);
        assert_eq!(
            m.rank_at(&[(&Axis::DP, 1), (&Axis::CP, 1), (&Axis::TP, 3)]),
            (2 + 1) * 4 + 3
        );
    }

    #[test]
    fn both_versions_of_the_mesh_read_and_version_2_is_written() {
        let v1: Mesh = serde_json::from_str(r#"{"tp": 2, "cp": 1, "dp": 4, "sp": true}"#).unwrap();
        assert_eq!(v1, Mesh::megatron(2, 1, 4, true).unwrap());
        // Megatron's mesh keeps its short form; the named form reads the same.
        let text = serde_json::to_string(&v1).unwrap();
        assert_eq!(text, r#"{"tp":2,"cp":1,"dp":4,"sp":true}"#);
        let named = r#"{"axes":[{"name":"dp","size":4},{"name":"cp","size":1},{"name":"tp","size":2}],"sp":true}"#;
        assert_eq!(serde_json::from_str::<Mesh>(named).unwrap(), v1);
        // Another order of the same axes is another mesh (other ranks), written named.
        let tp_outer = Mesh::new([(Axis::TP, 2), (Axis::CP, 1), (Axis::DP, 4)]).unwrap();
        assert_ne!(tp_outer, v1);
        assert_eq!(tp_outer.coord(1, &Axis::DP), 1);
        let text = serde_json::to_string(&tp_outer).unwrap();
        assert!(
            text.starts_with(r#"{"axes":[{"name":"tp","size":2}"#),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<Mesh>(&text).unwrap(), tp_outer);
        let pp: Mesh = serde_json::from_str(
            r#"{"axes": [{"name": "pp", "size": 3}, {"name": "dp_shard", "size": 2}]}"#,
        )
        .unwrap();
        assert_eq!((pp.world(), pp.label()), (6, "pp3-dp_shard2".to_string()));
        for bad in [
            r#"{"axes": [{"name": "tp", "size": 2}, {"name": "tp", "size": 2}]}"#,
            r#"{"axes": [{"name": "TP", "size": 2}]}"#,
            r#"{"axes": [{"name": "tp", "size": 0}]}"#,
            r#"{"axes": [{"name": "a", "size": 1048576}, {"name": "b", "size": 2}]}"#,
            r#"{"tp": 2, "cp": 1}"#,
            r#"{"tp": 2, "cp": 1, "dp": 1, "axes": []}"#,
            r#"{"tp": 2, "cp": 1, "dp": 1, "pp": 2}"#,
        ] {
            assert!(serde_json::from_str::<Mesh>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn axis_names_are_checked() {
        for good in ["dp", "dp_shard", "ep2", "x"] {
            assert_eq!(Axis::new(good).unwrap().name(), good);
        }
        for bad in ["", "2d", "Tp", "t p", "_x", &"a".repeat(33)] {
            assert!(matches!(
                Axis::new(bad),
                Err(Error::InvalidParameter { name: "axis", .. })
            ));
        }
    }
}
