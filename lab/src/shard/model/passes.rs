//! The sharded forward and backward of every module kind: the per-rank computations, the
//! collectives between them, and the gradient reductions (Megatron-LM's placement of each).

use super::*;

impl ShardedGpt {
    pub(super) fn forward(&mut self, m: &Module, inputs: &[Dist]) -> Result<(Dist, Saved)> {
        let world = self.mesh.world();
        let cfg = self.model.config().clone();
        match m.kind {
            ModuleKind::Embedding => {
                let p = self.policy(OpClass::Elementwise, Pass::Forward);
                let wte = self.model.param("embedding.wte")?.clone();
                let wpe = self.model.param("embedding.wpe")?.clone();
                let shards = (0..world)
                    .map(|r| {
                        let (ids, _, pos, bl) = self.local_tokens(r, true);
                        let rows: Vec<f64> = pos
                            .iter()
                            .flat_map(|&q| {
                                wpe.values()[q * cfg.hidden..(q + 1) * cfg.hidden].to_vec()
                            })
                            .collect();
                        let wpe_l = Tensor::from_parts_unchecked(
                            &[pos.len(), cfg.hidden],
                            rows,
                            wpe.format(),
                        );
                        embedding(&ids, bl, pos.len(), &wte, &wpe_l, &p)
                    })
                    .collect::<Result<_>>()?;
                Ok((
                    Dist {
                        shards,
                        layout: self.region(),
                    },
                    Saved::None,
                ))
            }
            ModuleKind::Norm => {
                let p = self.policy(OpClass::Norm, Pass::Forward);
                let w = self.model.param(&m.params[0])?.clone();
                let eps = if self.bug == Some(Bug::NormEpsMismatch) {
                    10.0 * cfg.norm_eps
                } else {
                    cfg.norm_eps
                };
                let mut shards = vec![];
                let mut saved = vec![];
                for x in &inputs[0].shards {
                    let (o, s) = match cfg.norm {
                        NormKind::LayerNorm => layer_norm(
                            x,
                            &w,
                            self.model.param(&m.params[1])?,
                            eps,
                            cfg.variance,
                            &p,
                        )?,
                        NormKind::RmsNorm => rms_norm(x, &w, eps, &p)?,
                    };
                    shards.push(o);
                    saved.push(s);
                }
                Ok((
                    Dist {
                        shards,
                        layout: inputs[0].layout.clone(),
                    },
                    Saved::Norm(saved),
                ))
            }
            ModuleKind::Linear => self.linear_forward(m, &inputs[0]),
            ModuleKind::Attention => {
                let p = self.policy(OpClass::Softmax, Pass::Forward);
                let heads = cfg.heads / self.mesh.size(&Axis::TP);
                let layout = self.act(Placement::split(2));
                let d = cfg.hidden / cfg.heads;
                let ar_scale = |dd: f64| {
                    p.accumulator()
                        .round(1.0 / dd.sqrt(), Overflow::NonSaturating)
                };
                // The bug: the head dimension taken as the per-rank width over all heads.
                let scale = (self.bug == Some(Bug::SoftmaxScaleFromLocalWidth))
                    .then(|| ar_scale(d as f64 / self.mesh.size(&Axis::TP) as f64));
                if self.mesh.size(&Axis::CP) == 1 {
                    let mut shards = vec![];
                    let mut saved = vec![];
                    for x in &inputs[0].shards {
                        let (o, s) =
                            attention_with_scale(x, heads, true, cfg.attention, &p, scale)?;
                        shards.push(o);
                        saved.push(s);
                    }
                    return Ok((Dist { shards, layout }, Saved::Attention(saved)));
                }
                let chunk = cfg.seq / (2 * self.mesh.size(&Axis::CP));
                let block = match cfg.attention {
                    AttentionImpl::Online { block } => block,
                    AttentionImpl::Standard => chunk,
                };
                let mut shards = vec![Tensor::zeros(&[], p.output); world];
                let mut saved = vec![];
                for g in self.cp_groups() {
                    let parts: Vec<Tensor> =
                        g.iter().map(|&r| inputs[0].shards[r].clone()).collect();
                    let opts = RingOptions {
                        scale,
                        contiguous_positions: self.bug == Some(Bug::CpChunkOrderNotInverted),
                        remote_lse_offset: if self.bug == Some(Bug::CpWrongLseCorrection) {
                            std::f64::consts::LN_2
                        } else {
                            0.0
                        },
                        stale_kv: self.bug == Some(Bug::CpStaleKvBlock),
                    };
                    let (outs, s) = ring_attention_with(&parts, heads, block, &p, opts)?;
                    for (&r, o) in g.iter().zip(outs) {
                        shards[r] = o;
                    }
                    saved.push((g, s));
                }
                Ok((Dist { shards, layout }, Saved::Ring(saved)))
            }
            ModuleKind::Activation => {
                let p = self.policy(OpClass::Elementwise, Pass::Forward);
                let shards = inputs[0]
                    .shards
                    .iter()
                    .map(|x| match cfg.activation {
                        Activation::Gelu => gelu(x, &p),
                        Activation::Silu => silu(x, &p),
                    })
                    .collect::<Result<_>>()?;
                Ok((Dist::like(shards, &inputs[0]), Saved::None))
            }
            ModuleKind::Residual => {
                let p = self.policy(OpClass::Elementwise, Pass::Forward);
                if inputs[0].layout != inputs[1].layout {
                    return Err(Error::Layout {
                        id: m.name.clone(),
                        reason: "the two residual inputs have different layouts".into(),
                    });
                }
                let shards = inputs[0]
                    .shards
                    .iter()
                    .zip(&inputs[1].shards)
                    .map(|(a, b)| nn::add(a, b, &p))
                    .collect::<Result<_>>()?;
                Ok((Dist::like(shards, &inputs[0]), Saved::None))
            }
            ModuleKind::Loss => {
                let p = self.policy(OpClass::Loss, Pass::Forward);
                let full = self.gather_tp(&inputs[0].shards, 2, "logits")?;
                let mut locals = vec![];
                let mut logits = vec![];
                for (r, z) in full.iter().enumerate() {
                    let z2 = Self::flatten(z)?;
                    let (_, tg, _, _) = self.local_tokens(r, false);
                    locals.push(cross_entropy(&z2, &tg, &p)?);
                    logits.push(z2);
                }
                self.all_reduce_groups(&mut locals, &self.dpcp_groups(), p.output)?;
                let ar = Arith::new(p.accumulator(), p.output, p.accumulation.overflow);
                let n = (self.mesh.size(&Axis::DP) * self.mesh.size(&Axis::CP)) as f64;
                let shards = locals
                    .iter()
                    .map(|t| {
                        let v = t.values().first().copied().unwrap_or(f64::NAN);
                        Tensor::from_parts_unchecked(&[], vec![ar.ro(ar.div(v, n))], p.output)
                    })
                    .collect();
                Ok((
                    Dist {
                        shards,
                        layout: Layout::replicated(),
                    },
                    Saved::Loss(logits),
                ))
            }
        }
    }

    pub(super) fn linear_forward(&mut self, m: &Module, x: &Dist) -> Result<(Dist, Saved)> {
        let p = self.policy(OpClass::Matmul, Pass::Forward);
        let par = self.style(&m.name);
        let w = self.param_shards(&m.params[0])?;
        let bias = match m.params.get(1) {
            Some(n) => Some(self.param_shards(n)?),
            None => None,
        };
        let xs = match par {
            ParallelStyle::Colwise { .. } if self.mesh.sequence_parallel() => {
                self.gather_tp(&x.shards, 1, &m.name)?
            }
            _ => x.shards.clone(),
        };
        let x2: Vec<Tensor> = xs.iter().map(Self::flatten).collect::<Result<_>>()?;
        let sx = self.scale_for(format!("{}.input", m.name), &x2, &p, p.input(), true);
        let sw = self.scale_for(format!("{}.weight", m.name), &w, &p, p.rhs(), true);
        let world = self.mesh.world();
        let mut out = Vec::with_capacity(world);
        let bias_here = par != ParallelStyle::Rowwise
            || self.mesh.size(&Axis::TP) == 1
            || self.bug == Some(Bug::RowBiasOnEveryRank);
        for r in 0..world {
            let b = if bias_here {
                bias.as_ref().map(|b| &b[r])
            } else {
                None
            };
            let y = linear_scaled(&x2[r], &w[r], b, &p, sx[r], sw[r])?;
            let mut shape = xs[r].shape().to_vec();
            let last = shape.len() - 1;
            shape[last] = w[r].shape()[0];
            out.push(y.reshape(&shape)?);
        }
        let layout = match par {
            ParallelStyle::Colwise { groups } => self.act(Placement::Split { dim: 2, groups }),
            ParallelStyle::Rowwise => {
                if self.mesh.size(&Axis::TP) > 1 {
                    let act = self.model.recipe().activation_format;
                    if self.bug == Some(Bug::ReduceScatterWrongDim) && self.mesh.sequence_parallel()
                    {
                        self.reduce_scatter_batch_dim(&mut out, act)?;
                    } else {
                        self.reduce_tp(&mut out, act)?;
                    }
                    if let (Some(b), false) = (&bias, bias_here) {
                        let ar = Arith::new(p.accumulator(), p.output, p.accumulation.overflow);
                        for (r, y) in out.iter_mut().enumerate() {
                            let bv = b[r].values();
                            let h = bv.len();
                            let vals: Vec<f64> = y
                                .values()
                                .iter()
                                .enumerate()
                                .map(|(i, &v)| ar.ro(ar.add(v, bv[i % h])))
                                .collect();
                            *y = Tensor::from_parts_unchecked(y.shape(), vals, p.output);
                        }
                    }
                }
                self.region()
            }
        };
        Ok((
            Dist {
                shards: out,
                layout,
            },
            Saved::Linear(x2),
        ))
    }

    /// Backward of one module: gradients per input, and (parameter, per-rank gradient) pairs
    /// before the data-parallel reduction.
    pub(super) fn backward(
        &mut self,
        m: &Module,
        inputs: &[Dist],
        saved: &Saved,
        g: &Dist,
    ) -> Result<Backward> {
        let cfg = self.model.config().clone();
        let gf = self.model.recipe().grad_format;
        let world = self.mesh.world();
        match (m.kind, saved) {
            (ModuleKind::Embedding, _) => {
                let p = self.policy(OpClass::Elementwise, Pass::Backward);
                let mut dte = vec![];
                let mut dpe = vec![];
                for r in 0..world {
                    let (ids, _, pos, bl) = self.local_tokens(r, true);
                    let (a, b) = embedding_backward(
                        &ids,
                        bl,
                        pos.len(),
                        cfg.vocab,
                        pos.len(),
                        &g.shards[r],
                        &p,
                        gf,
                    )?;
                    let mut full = vec![0.0; cfg.seq * cfg.hidden];
                    for (i, &q) in pos.iter().enumerate() {
                        full[q * cfg.hidden..(q + 1) * cfg.hidden]
                            .copy_from_slice(&b.values()[i * cfg.hidden..(i + 1) * cfg.hidden]);
                    }
                    dte.push(a);
                    dpe.push(Tensor::from_parts_unchecked(
                        &[cfg.seq, cfg.hidden],
                        full,
                        gf,
                    ));
                }
                Ok((
                    vec![],
                    vec![(m.params[0].clone(), dte), (m.params[1].clone(), dpe)],
                ))
            }
            (ModuleKind::Norm, Saved::Norm(s)) => {
                let p = self.policy(OpClass::Norm, Pass::Backward);
                let w = self.model.param(&m.params[0])?.clone();
                let mut dx = vec![];
                let mut dw = vec![];
                let mut db = vec![];
                for (sr, gr) in s.iter().zip(&g.shards) {
                    let (a, b, c) =
                        norm_backward(sr, &w, gr, cfg.norm == NormKind::LayerNorm, &p, gf)?;
                    dx.push(a);
                    dw.push(b);
                    if let Some(c) = c {
                        db.push(c);
                    }
                }
                let mut pg = vec![(m.params[0].clone(), dw)];
                if !db.is_empty() {
                    pg.push((m.params[1].clone(), db));
                }
                Ok((
                    vec![Dist {
                        shards: dx,
                        layout: inputs[0].layout.clone(),
                    }],
                    pg,
                ))
            }
            (ModuleKind::Linear, Saved::Linear(x2)) => self.linear_backward(m, inputs, x2, g),
            (ModuleKind::Attention, Saved::Attention(s)) => {
                let p = self.policy(OpClass::Softmax, Pass::Backward);
                let shards = s
                    .iter()
                    .zip(&g.shards)
                    .map(|(s, g)| attention_backward(s, g, &p))
                    .collect::<Result<_>>()?;
                Ok((vec![Dist::like(shards, &inputs[0])], vec![]))
            }
            (ModuleKind::Attention, Saved::Ring(groups)) => {
                let p = self.policy(OpClass::Softmax, Pass::Backward);
                let mut shards = vec![Tensor::zeros(&[], p.output); world];
                for (ranks, s) in groups {
                    let douts: Vec<Tensor> = ranks.iter().map(|&r| g.shards[r].clone()).collect();
                    let d = ring_attention_backward(s, &douts, &p)?;
                    for (&r, t) in ranks.iter().zip(d) {
                        shards[r] = t;
                    }
                }
                Ok((vec![Dist::like(shards, &inputs[0])], vec![]))
            }
            (ModuleKind::Activation, _) => {
                let p = self.policy(OpClass::Elementwise, Pass::Backward);
                let shards = inputs[0]
                    .shards
                    .iter()
                    .zip(&g.shards)
                    .map(|(x, g)| match cfg.activation {
                        Activation::Gelu => gelu_backward(x, g, &p),
                        Activation::Silu => silu_backward(x, g, &p),
                    })
                    .collect::<Result<_>>()?;
                Ok((vec![Dist::like(shards, &inputs[0])], vec![]))
            }
            (ModuleKind::Residual, _) => {
                let p = self.policy(OpClass::Elementwise, Pass::Backward);
                let shards: Vec<Tensor> = g
                    .shards
                    .iter()
                    .map(|t| t.cast(p.output, p.input_overflow(p.output)))
                    .collect();
                let d = Dist {
                    shards,
                    layout: g.layout.clone(),
                };
                Ok((vec![d.clone(), d], vec![]))
            }
            (ModuleKind::Loss, Saved::Loss(logits)) => {
                let p = self.policy(OpClass::Loss, Pass::Backward);
                let (dp, cp) = (
                    self.mesh.size(&Axis::DP) as f64,
                    self.mesh.size(&Axis::CP) as f64,
                );
                let seed = match self.bug {
                    Some(Bug::DpGradSummedNotAveraged) => 1.0 / cp,
                    Some(Bug::MissingMicrobatchDivision) => 1.0 / dp,
                    _ => 1.0 / (dp * cp),
                };
                let mut full = vec![];
                for (r, z) in logits.iter().enumerate() {
                    let (_, tg, _, _) = self.local_tokens(r, false);
                    let dz = cross_entropy_backward(z, &tg, seed, &p)?;
                    let mut shape = inputs[0].shards[r].shape().to_vec();
                    let last = shape.len() - 1;
                    shape[last] = cfg.vocab;
                    full.push(dz.reshape(&shape)?);
                }
                let shards = self.slice_tp(&full, 2, "logit gradient")?;
                Ok((vec![Dist::like(shards, &inputs[0])], vec![]))
            }
            (kind, _) => Err(Error::InvalidParameter {
                name: "saved",
                reason: format!("module '{}' of kind {kind:?} has no saved state", m.name),
            }),
        }
    }

    pub(super) fn linear_backward(
        &mut self,
        m: &Module,
        inputs: &[Dist],
        x2: &[Tensor],
        g: &Dist,
    ) -> Result<Backward> {
        let dg = self.policy(OpClass::MatmulGradInput, Pass::Backward);
        let wg = self.policy(OpClass::MatmulGradWeight, Pass::Backward);
        let gf = self.model.recipe().grad_format;
        let par = self.style(&m.name);
        let w = self.param_shards(&m.params[0])?;
        let world = self.mesh.world();
        // Row-parallel layers under SP gather the output gradient along the sequence.
        let gs = match par {
            ParallelStyle::Rowwise if self.mesh.sequence_parallel() => {
                self.gather_tp(&g.shards, 1, &m.name)?
            }
            _ => g.shards.clone(),
        };
        let g2: Vec<Tensor> = gs.iter().map(Self::flatten).collect::<Result<_>>()?;
        let s_g = self.scale_for(format!("{}.grad", m.name), &g2, &dg, dg.input(), true);
        let s_w = self.scale_for(format!("{}.weight", m.name), &w, &dg, dg.rhs(), false);
        let s_x = self.scale_for(format!("{}.input", m.name), x2, &wg, wg.rhs(), false);
        let mut dx = Vec::with_capacity(world);
        let mut dw = Vec::with_capacity(world);
        let mut db = Vec::with_capacity(world);
        for r in 0..world {
            let d = matmul_scaled(&g2[r], &w[r], &dg, s_g[r], s_w[r])?;
            let mut shape = gs[r].shape().to_vec();
            let last = shape.len() - 1;
            shape[last] = w[r].shape()[1];
            dx.push(d.reshape(&shape)?);
            let gt = transpose(&g2[r], "linear output gradient")?;
            dw.push(
                matmul_scaled(&gt, &x2[r], &wg, s_g[r], s_x[r])?.cast(gf, Overflow::NonSaturating),
            );
            if m.params.len() > 1 {
                let mut bp = wg.clone();
                bp.output = gf;
                // Under SP a row-parallel bias sums the rank's own sequence piece.
                let src = if par == ParallelStyle::Rowwise && self.mesh.sequence_parallel() {
                    Self::flatten(&g.shards[r])?
                } else {
                    g2[r].clone()
                };
                db.push(column_sums(&src, &bp)?);
            }
        }
        let layout = match par {
            ParallelStyle::Colwise { .. } => {
                self.reduce_tp(&mut dx, self.model.recipe().activation_format)?;
                self.region()
            }
            ParallelStyle::Rowwise => self.act(Placement::split(2)),
        };
        debug_assert_eq!(layout, inputs[0].layout);
        let mut pg = vec![(m.params[0].clone(), dw)];
        if m.params.len() > 1 {
            pg.push((m.params[1].clone(), db));
        }
        Ok((vec![Dist { shards: dx, layout }], pg))
    }

    /// Reduce a parameter gradient over the ranks that computed different parts of it: the
    /// DP×CP group, and for replicated parameters under SP the TP group too.
    pub(super) fn reduce_param_grad(&self, name: &str, shards: &mut [Tensor]) -> Result<Layout> {
        let layout = self.param_layout(name);
        let gf = self.model.recipe().grad_format;
        let is_norm = [".ln1.", ".ln2.", "final_ln."]
            .iter()
            .any(|n| name.contains(n));
        let is_row_bias = name.ends_with(".bias")
            && self.plan.style_of_param(name) == Some(ParallelStyle::Rowwise);
        let is_embedding = name.starts_with("embedding.");
        // The reduction format: FP32 gradients all-reduced in BF16 under the bug, then kept
        // in the gradient format.
        let red = if self.bug == Some(Bug::GradAllReduceInBf16) {
            Format::BF16
        } else {
            gf
        };
        if self.bug == Some(Bug::EmbeddingGradNotDpReduced) && is_embedding {
            // Only the context-parallel part of the reduction happens.
            self.all_reduce_groups(shards, &self.cp_groups(), red)?;
        } else {
            self.all_reduce_groups(shards, &self.dpcp_groups(), red)?;
        }
        let skip_tp = (self.bug == Some(Bug::SpNormGradNotReduced) && is_norm)
            || (self.bug == Some(Bug::SpRowBiasGradNotReduced) && is_row_bias);
        if layout.along(&Axis::TP) == Placement::Replicate
            && self.mesh.sequence_parallel()
            && !skip_tp
        {
            self.all_reduce_groups(shards, &self.tp_groups(), red)?;
        }
        if red != gf {
            for t in shards.iter_mut() {
                *t = t.cast(gf, Overflow::NonSaturating);
            }
        }
        Ok(layout)
    }
}
