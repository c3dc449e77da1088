// adamw.wgsl — one AdamW step over the flat parameter arena (all tensors of the
// Size letters: B batch, L seqLen, Dm dModel, D dInner, N dState, K dConv, R dtRank,
// P = R + 2N, M = B*L rows, V vocab, T scan chunk. common.wgsl is prepended by the loader.
// model in one buffer; tensors with weight decay first, n_decay elements), the
// same per-element maths as mamba_ext/_adamw.pyx (PyTorch AdamW):
//   m = m + (1-b1)(g - m);  v = b2 v + (1-b2) g^2
//   d = lr*wd*w [i < n_decay] + lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
//   d clamped to [-max_delta, max_delta] when max_delta > 0 (decay inside the clamp)
//   w -= d, unless d or v is non-finite (per-element NaN guard).
// Whole-step NaN guard: when reduce.wgsl's stat[1] (non-finite gradient count)
// is > 0 nothing is written at all (weights and moments untouched). Bias
// corrections come from the host (float64, rounded once) for the step number
// that the host counts from the returned skip flag.
//
// adamw_step bindings (one invocation per element, 2-D grid):
//   0 p     uniform  Params
//   1 w     (n)      read_write  parameter arena
//   2 m     (n)      read_write  first moments
//   3 v     (n)      read_write  second moments
//   4 g     (n)      read        gradient arena
//   5 stat  (4)      read        (sum of squares, non-finite count) of g
// Global-norm clipping: clip > 0 scales g by clip / norm when norm > clip.

struct Params {
    n: u32, n_decay: u32,
    omb1: f32, b2: f32, omb2: f32, decay: f32,
    step_size: f32, sqrt_bc2: f32, eps: f32, max_delta: f32, clip: f32,
}

override WG: u32 = 256u;
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> w: array<f32>;
@group(0) @binding(2) var<storage, read_write> m: array<f32>;
@group(0) @binding(3) var<storage, read_write> v: array<f32>;
@group(0) @binding(4) var<storage, read> g: array<f32>;
@group(0) @binding(5) var<storage, read> stat: array<f32>;

@compute @workgroup_size(WG)
fn adamw_step(@builtin(local_invocation_index) li: u32,
              @builtin(workgroup_id) wid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n || stat[1] > 0.0) { return; }
    var gs = 1.0;
    let norm = sqrt(stat[0]);
    if (p.clip > 0.0 && norm > p.clip) { gs = p.clip / norm; }
    let gi = g[i] * gs;
    let wi = w[i];
    let mi = m[i] + p.omb1 * (gi - m[i]);
    let vi = p.b2 * v[i] + p.omb2 * gi * gi;
    var decay = 0.0;
    if (i < p.n_decay) { decay = p.decay; }
    var d = decay * wi + p.step_size * mi / (sqrt(vi) / p.sqrt_bc2 + p.eps);
    if (not_finite(d) || not_finite(vi)) { return; }
    if (p.max_delta > 0.0) { d = clamp(d, -p.max_delta, p.max_delta); }
    w[i] = wi - d;
    m[i] = mi;
    v[i] = vi;
}
