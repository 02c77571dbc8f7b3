#!/usr/bin/env python3
"""How far any norm test could go: the idealized χ² norm test on `ttrace validate --json` output.

For every correct tensor that differs, take the difference simulation's expected relative
difference E (in ε) and the effective rank k of its covariance as exact, model ‖Δ‖²/E² as
χ²_k/k, and put the threshold at its 0.9·10⁻⁶ upper quantile (the norm's share of δ = 10⁻⁶).
An isotropic Gaussian perturbation of relative size ρ adds ρ² to ‖Δ‖²; it is detected with 99%
power when the null's lower 1% plus ρ² reaches the threshold. The median of that ρ* per recipe
and class is a floor for every test that judges a tensor by its norm alone, however tightly
priced (and the idealized threshold itself false-alarms where χ²_k/k is not the law: the FA
column). Standard library only.

    ttrace validate --full --json out.json && python3 scripts/ideal_norm.py out.json
"""
import sys
import json, math, statistics as st
from collections import defaultdict
def gammq(a,x):
    # upper regularized incomplete gamma Q(a,x)
    if x < a+1:
        ap=a; s=1/a; d=s
        for _ in range(100000):
            ap+=1; d*=x/ap; s+=d
            if abs(d)<abs(s)*1e-15: break
        return 1-s*math.exp(-x+a*math.log(x)-math.lgamma(a))
    b=x+1-a; c=1/1e-300; d=1/b; h=d
    for i in range(1,100000):
        an=-i*(i-a); b+=2; d=an*d+b; d=1e-300 if abs(d)<1e-300 else d
        c=b+an/c; c=1e-300 if abs(c)<1e-300 else c
        d=1/d; de=d*c; h*=de
        if abs(de-1)<1e-15: break
    return math.exp(-x+a*math.log(x)-math.lgamma(a))*h
def chi2_upper_q(k,p):  # x with P(chi2_k > x) = p
    lo,hi=0.0,k+200*math.sqrt(2*k)+200
    for _ in range(200):
        m=(lo+hi)/2
        if gammq(k/2,m/2)>p: lo=m
        else: hi=m
    return hi
cache={}
def q(k,p):
    k=max(1,round(k)); key=(k,p)
    if key not in cache: cache[key]=chi2_upper_q(k,p)
    return cache[key]
d=json.load(open(sys.argv[1] if len(sys.argv) > 1 else 'validate.json'))
g=defaultdict(list)
for r in d['runs']:
  rec=r['config']['recipe']
  for t in r['tensors']:
    if t['observed']==0 or t['expected']==0: continue
    k=t['kind']
    cls='param grads' if k.startswith('param') else ('activation grads' if k.endswith('bwd') else 'activations')
    E=t['expected']/t['eps']; kk=t['effective_rank']
    Th=E*math.sqrt(q(kk,0.9e-6)/max(1,round(kk)))
    lo=E*E*q(kk,0.99)/max(1,round(kk))
    rho=math.sqrt(max(Th*Th-lo,0))
    fa = t['observed']/t['eps']>Th
    g[(rec,cls)].append((rho,fa,t['observed']/t['eps']))
print("| recipe | class | tensors | observed (ε, median) | idealized norm ρ* (ε, median) | its false alarms |")
print("|---|---|---|---|---|---|")
for (rec, cls), v in sorted(g.items()):
    print("| %s | %s | %d | %.2f | %.2f | %d |" % (
        rec, cls, len(v), st.median(x[2] for x in v), st.median(x[0] for x in v),
        sum(x[1] for x in v)))
