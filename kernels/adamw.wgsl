// adamw.wgsl — one AdamW step over the flat parameter arena (all tensors of the
// model in one buffer; tensors with weight decay first, n_decay elements), and
// the gradient norm it needs. The GPU side of mamba_ext/cpu/adamw.pyx (same
// per-element maths, PyTorch AdamW). common.wgsl is prepended by the loader.
//
// Size letters: n elements of the arena, G = ceil(n / (256 * ITEMS)) workgroups
// of adamw_sumsq_partial.
//
//   m = m + (1-b1)(g - m);  v = b2 v + (1-b2) g^2
//   d = lr*wd*w [i < n_decay] + lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
//   d clamped to [-max_delta, max_delta] when max_delta > 0 (decay inside the clamp)
//   w -= d, unless d or v is non-finite (per-element NaN guard).
// Whole-step NaN guard: when stat[1] (non-finite gradient count, from
// adamw_sumsq_*) is > 0 nothing is written at all (weights and moments
// untouched). Bias corrections come from the host (float64, rounded once), for
// two candidate step numbers: the host submits a step before it has read whether
// the one before was taken (ResidentTrainer.step_async), so it passes t_c (the
// steps it knows were taken, mod COUNT_MOD) and the corrections of step t_c + 1
// (step_size, sqrt_bc2) and of t_c + 2 (step_size_b, sqrt_bc2_b); stat[2] counts the
// steps taken on the GPU (mod COUNT_MOD, adamw_sumsq_final adds 1 when a step is
// not skipped), and adamw_step takes the pair whose number equals that count.
// Global-norm clipping: clip > 0 scales g by clip / norm when norm > clip.
//
// Bindings:
// | entry               | binding: name shape access                                      |
// |---------------------|-----------------------------------------------------------------|
// | adamw_sumsq_partial | 0 sp SqParams uniform; 1 x (n) r; 2 part (2G) rw: per workgroup  |
// |                     | (sum of squares, non-finite count) of 256*ITEMS elements          |
// | adamw_sumsq_final   | 0 sp uniform; 1 part (2G) r; 2 stat (4) rw: stat[0] sum of       |
// |                     | squares, stat[1] non-finite count (fixed-order sums of part),    |
// |                     | stat[2] steps taken mod COUNT_MOD (+1 unless stat[1] > 0)         |
// | adamw_step          | 0 p Params uniform; 1 w (n) rw; 2 m (n) rw; 3 v (n) rw;          |
// |                     | 4 g (n) r; 5 stat (4) r                                          |

struct Params {
    n: u32, n_decay: u32,
    omb1: f32, b2: f32, omb2: f32, decay: f32,
    step_size: f32, sqrt_bc2: f32, eps: f32, max_delta: f32, clip: f32,
    t_c: f32, step_size_b: f32, sqrt_bc2_b: f32,
}
struct SqParams { n: u32, groups: u32 }

override WG: u32 = 256u;
const ITEMS: u32 = 8u;
// The step count is kept modulo COUNT_MOD in a float (exact below 2^24): adamw_step only
// has to tell the host's t_c + 1 from t_c + 2 (mamba_ext/gpu/adamw.py COUNT_MOD).
const COUNT_MOD: f32 = 1048576.0;

// ------------------------------------------------------------ gradient norm
var<workgroup> red: array<f32, 256>;    // (256,) partial sums of squares
var<workgroup> red2: array<f32, 256>;   // (256,) partial non-finite counts

@group(0) @binding(0) var<uniform> sp: SqParams;
@group(0) @binding(1) var<storage, read> s_x: array<f32>;
@group(0) @binding(2) var<storage, read_write> s_part: array<f32>;

// Tree sums of red and red2 over 256 slots (fixed order).
fn tree2(li: u32) {
    for (var h = 128u; h > 0u; h = h / 2u) {
        if (li < h) { red[li] += red[li + h]; red2[li] += red2[li + h]; }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn adamw_sumsq_partial(@builtin(local_invocation_index) li: u32,
                       @builtin(workgroup_id) wid: vec3<u32>,
                       @builtin(num_workgroups) nwg: vec3<u32>) {
    let g = wid.y * nwg.x + wid.x;
    var ss = 0.0;
    var bad = 0.0;
    for (var q = 0u; q < ITEMS; q++) {
        let i = (g * ITEMS + q) * 256u + li;
        if (i < sp.n) {
            let v = s_x[i];
            if (not_finite(v)) { bad += 1.0; } else { ss += v * v; }
        }
    }
    red[li] = ss;
    red2[li] = bad;
    workgroupBarrier();
    tree2(li);
    if (li == 0u && g < sp.groups) { s_part[2u * g] = red[0]; s_part[2u * g + 1u] = red2[0]; }
}

@group(0) @binding(1) var<storage, read> f_part: array<f32>;
@group(0) @binding(2) var<storage, read_write> f_stat: array<f32>;

@compute @workgroup_size(256)
fn adamw_sumsq_final(@builtin(local_invocation_index) li: u32) {
    var ss = 0.0;
    var bad = 0.0;
    for (var g = li; g < sp.groups; g += 256u) { ss += f_part[2u * g]; bad += f_part[2u * g + 1u]; }
    red[li] = ss;
    red2[li] = bad;
    workgroupBarrier();
    tree2(li);
    if (li == 0u) {
        f_stat[0] = red[0];
        f_stat[1] = red2[0];
        if (red2[0] == 0.0) { f_stat[2] = (f_stat[2] + 1.0) % COUNT_MOD; }   // a step taken
    }
}

// --------------------------------------------------------------- the step
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
    // this step's number (taken: counted by adamw_sumsq_final) is t_c + 1 or t_c + 2
    let late = (stat[2] - p.t_c + COUNT_MOD) % COUNT_MOD == 2.0;
    let step_size = select(p.step_size, p.step_size_b, late);
    let sqrt_bc2 = select(p.sqrt_bc2, p.sqrt_bc2_b, late);
    var gs = 1.0;
    let norm = sqrt(stat[0]);
    if (p.clip > 0.0 && norm > p.clip) { gs = p.clip / norm; }
    let gi = g[i] * gs;
    let wi = w[i];
    let mi = m[i] + p.omb1 * (gi - m[i]);
    let vi = p.b2 * v[i] + p.omb2 * gi * gi;
    var decay = 0.0;
    if (i < p.n_decay) { decay = p.decay; }
    var d = decay * wi + step_size * mi / (sqrt(vi) / sqrt_bc2 + p.eps);
    if (not_finite(d) || not_finite(vi)) { return; }
    if (p.max_delta > 0.0) { d = clamp(d, -p.max_delta, p.max_delta); }
    w[i] = wi - d;
    m[i] = mi;
    v[i] = vi;
}
