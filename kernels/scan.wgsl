// scan.wgsl — the selective scan (S6), forward and backward, chunked over time.
// The GPU side of mamba_ext/cpu/scan.pyx. common.wgsl is prepended by the loader.
//
// Size letters: B batch, L seqLen, D dInner, N dState, R dtRank, P = R + 2N,
// M = B*L rows, SCAN_CHUNK steps per chunk (Params.chunk), C = ceil(L / SCAN_CHUNK)
// chunks, G channel groups (workgroups along D), SG = ceil(N / 16) state groups.
//
// Per (b, d, n), with A = -exp(clamp(A_log, a_log_min, a_log_max)) and x_t = delta_t * A:
//   a_t = exp(x_t),  b_t = coef_t * Bs_t,  coef_t = expm1(x_t)/A (ZOH) | delta_t (Euler)
//   h_t = a_t h_{t-1} + b_t u_t,  y_t = sum_n Cs_t h_t + D_vec u_t
// Time is cut into C chunks of SCAN_CHUNK steps (the last may be shorter). Forward:
//   scan_forward_chunk   every chunk from a zero state: y of that state (all of y in
//                        chunk 0), its end state hchunk and its decay product
//                        achunk = prod_t a_t
//   scan_forward_carry   per (b,d,n) over chunks: hstate[c] = state entering chunk c
//                        (hstate[0] = 0, hstate[c+1] = achunk[c] hstate[c] + hchunk[c])
//   scan_forward_correct chunks c >= 1: y_t += sum_n Cs_t exp(A S_t) hstate[c], the part
//                        of the state entering the chunk (its decay to step t,
//                        prod_{tau <= t} a_tau = exp(A S_t), S_t = sum_{tau <= t} delta_tau
//                        within the chunk): 5 operations per state and step where a
//                        second walk of the recurrence took ~20
// Backward (g_t = dLoss/dh_t = Cs_t dy_t + a_{t+1} g_{t+1}):
//   scan_backward_chunk  every chunk from zero beyond its end: gchunk[c] = a_first * g_first
//   scan_backward_carry  gcarry[c] = carry into the last step of chunk c
//                        (gcarry[C-1] = 0, gcarry[c] = gchunk[c+1] + achunk[c+1] gcarry[c+1])
//   scan_backward_grads  every chunk: g is walked backward from gcarry[c] keeping its
//                        carry into each block of TS steps, then the blocks in order,
//                        the state carried from hstate[c]: the block's states
//                        recomputed into registers, then its steps backward from its carry;
//                        writes du, ddelta_pre (softplus backward fused), dA per
//                        (b, chunk) and the partial sums of dBs/dCs per channel group
//   scan_backward_sum_bc     dBs, dCs = sums of the channel-group partials -> dxproj columns
//   scan_backward_sum_a_log  dA_log += A * sum of dA partials, exactly 0 at/beyond the clamp
// With one chunk (C = 1) the host runs the forward's chunk pass alone (its y is all of y)
// and skips the backward's chunk and carry passes: the last chunk starts from a zero carry.
// All reductions are fixed-order sums (no float atomics): deterministic.
//
// Workgroup layout of the chunk kernels (why: the sums over n of y, du and ddelta
// stay in one invocation's registers, with no barrier per step): invocation li =
// channel dl = li / SG, state group s = li % SG; it holds the states
// n = 16 s + 4 q + k (q < NV vec4 registers, k < 4) of channel d = G_index * CPW + dl,
// CPW = WG / SG channels per workgroup; grid (G, C, B), G = ceil(D / CPW). Lanes
// past D or past N take part in barriers and contribute zero. The Bs | Cs columns
// of a block of TS steps are staged in workgroup memory (one coalesced load, read
// back as broadcast vec4). In scan_backward_grads, the sums over a channel's state groups
// (SG > 1) and dBs, dCs (sums over channels) are sum_step's: this file is compiled as
// part of scan_sums_workgroup.wgsl (sums through workgroup memory, every RB steps; SUB = 0)
// or, where the device has subgroups of SUB = 8, 16 or 32 invocations and SG = 1, of
// scan_sums_subgroup.wgsl (shuffles; the host sets SUB), each this file and one sum_step.
//
// Pipelining (why: a block's global loads, issued where they are used, left their latency
// and a barrier exposed at every block): each chunk kernel loads the next block's Bs | Cs
// (this invocation's share, into nbc) before it runs the current block's steps, and stores
// it into the other half of bc after them: one barrier per block, the loads in flight
// during the steps. The backward kernels and scan_forward_correct load the next block's
// per-step inputs ahead too (into n_dp, n_u, n_dy, n_y); scan_forward_chunk, with more
// work per step, reads them where it uses them (ahead, they ran slower: docs/performance.md,
// GPU tuning).
//
// Bindings (0 is the uniform Params in every entry point; one name per buffer, at one
// binding number in every entry point that binds it). xproj (M, P) holds dt_low =
// xproj[:, 0:R], Bs = xproj[:, R:R+N], Cs = xproj[:, R+N:P]; delta = softplus(delta_pre)
// is computed where it is read (no (M, D) delta buffer); w is the parameter arena
// (A_log (D, N) at alog_off, D_vec (D,) at dvec_off).
// | binding | name       | shape     | written by             | read by                         |
// |---------|------------|-----------|------------------------|---------------------------------|
// | 1       | xproj      | (M, P)    |                        | the chunk kernels               |
// | 2       | u          | (M, D)    |                        | forward_chunk/_correct, _grads  |
// | 3       | delta_pre  | (M, D)    |                        | the chunk kernels               |
// | 4       | w          | arena     |                        | the chunk kernels, sum_a_log    |
// | 5       | dy         | (M, D)    |                        | backward_chunk, backward_grads  |
// | 6       | hchunk     | (B,C,D,N) | forward_chunk          | forward_carry                   |
// | 7       | achunk     | (B,C,D,N) | forward_chunk          | forward_carry, backward_carry   |
// | 8       | hstate     | (B,C,D,N) | forward_carry          | forward_correct, backward_grads |
// | 9       | y          | (M, D)    | forward_chunk, forward_correct (+=)                      |
// | 10      | gchunk     | (B,C,D,N) | backward_chunk         | backward_carry                  |
// | 11      | gcarry     | (B,C,D,N) | backward_carry         | backward_grads                  |
// | 12      | da_part    | (B,C,D,N) | backward_grads         | backward_sum_a_log              |
// | 13      | du         | (M, D)    | backward_grads (scan part + D_vec dy)                    |
// | 14      | ddelta_pre | (M, D)    | backward_grads (softplus backward fused)                 |
// | 15      | dbc_part   | (GHS,M,2N)| backward_grads (GHS = G * HS) | backward_sum_bc          |
// | 16      | dxproj     | (M, P)    | backward_sum_bc (columns R..P overwritten)               |
// | 17      | grad       | arena     | backward_sum_a_log (A_log at alog_off, +=)               |

struct Params {
    B: u32, L: u32, D: u32, N: u32, R: u32, P: u32,
    chunk: u32, C: u32, G: u32, zoh: u32, alog_off: u32, dvec_off: u32,
}

// Clamp bounds of A_log, from mamba_ext.constants (A_LOG_MIN, A_LOG_MAX): no
// default on purpose, so a pipeline built without them fails to compile.
override a_log_min: f32;
override a_log_max: f32;

// A = -exp(clamp(A_log, A_LOG_MIN, A_LOG_MAX)).
fn a_of(a_log: f32) -> f32 { return -exp(clamp(a_log, a_log_min, a_log_max)); }

// Layout (set by mamba_ext/gpu/scan.py, ScanShape): WG = CPW * SG invocations;
// NV vec4 of states per invocation (ceil(N / 4) when SG = 1, else 4); TS steps
// per staged block (scan_backward_grads: also per recomputed block, TS <= TSMAX);
// RB steps per dBs/dCs reduction round (TS % RB == 0).
override WG: u32 = 32u;
override SG: u32 = 1u;
override NV: u32 = 4u;
override TS: u32 = 4u;
override RB: u32 = 2u;
// HS: partial sums of dBs/dCs per workgroup (scan_backward_grads): each sums WG / SG / HS
// of its channels (workgroup sums: so that HS * 32 invocations share the per-step sums
// instead of 32; subgroup sums: WG / SUB, one per subgroup) (dbc_part holds G * HS
// partials; Params.G counts them).
override HS: u32 = 1u;
// SUB: the subgroup size of scan_sums_subgroup.wgsl's sums, 0 for scan_sums_workgroup.wgsl's
// (declared here, before its uses: naga needs an override declared before it is read).
override SUB: u32 = 0u;
const TSMAX: u32 = 8u;     // recomputed steps held in registers (hist, hex, hco)
const CKMAX: u32 = 32u;    // checkpoints per chunk (the host keeps chunk <= CKMAX * TS)
const RS: u32 = 35u;       // floats per (step, invocation) row of red: dBs 16 | dCs 16 |
                           // du | ddelta | pad (35 is odd: the rows' stores hit distinct banks)

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> xproj: array<f32>;
@group(0) @binding(2) var<storage, read> u: array<f32>;
@group(0) @binding(3) var<storage, read> delta_pre: array<f32>;
@group(0) @binding(4) var<storage, read> w: array<f32>;
@group(0) @binding(5) var<storage, read> dy: array<f32>;
@group(0) @binding(6) var<storage, read_write> hchunk: array<f32>;
@group(0) @binding(7) var<storage, read_write> achunk: array<f32>;
@group(0) @binding(8) var<storage, read_write> hstate: array<f32>;
@group(0) @binding(9) var<storage, read_write> y: array<f32>;
@group(0) @binding(10) var<storage, read_write> gchunk: array<f32>;
@group(0) @binding(11) var<storage, read_write> gcarry: array<f32>;
@group(0) @binding(12) var<storage, read_write> da_part: array<f32>;
@group(0) @binding(13) var<storage, read_write> du: array<f32>;
@group(0) @binding(14) var<storage, read_write> ddelta_pre: array<f32>;
@group(0) @binding(15) var<storage, read_write> dbc_part: array<f32>;
@group(0) @binding(16) var<storage, read_write> dxproj: array<f32>;
@group(0) @binding(17) var<storage, read_write> grad: array<f32>;

// (2, TS, 2, SG, 4) vec4: two buffers (the block being run, the next one staged) of
// Bs (0) | Cs (1) of a block of TS steps, 16 states per group (zero past N and past
// the block's last step).
var<workgroup> bc: array<vec4<f32>, 2u * TS * 2u * SG * 4u>;
// (TS, WG) partial y of each invocation (scan_forward_chunk / _correct, SG > 1).
var<workgroup> ysum: array<f32, TS * WG>;
// (RB, WG, RS) per-step contributions of scan_backward_grads' workgroup sums, see RS.
var<workgroup> red: array<f32, RB * WG * RS>;

// This invocation's A, 1/A and running state, (4,) vec4 each (states n = 16 s + 4 q + k).
var<private> Av: array<vec4<f32>, 4>;
var<private> rA: array<vec4<f32>, 4>;
var<private> hv: array<vec4<f32>, 4>;

struct Lane { dl: u32, s: u32, d: u32, on: bool, b: u32, c: u32 }

fn lane(li: u32, wid: vec3<u32>) -> Lane {
    var l: Lane;
    l.dl = li / SG;
    l.s = li % SG;
    l.d = wid.x * (WG / SG) + l.dl;
    l.on = l.d < p.D;
    l.c = wid.y;
    l.b = wid.z;
    return l;
}

// State n of register q, component k.
fn state_of(l: Lane, q: u32, k: u32) -> u32 { return l.s * 16u + 4u * q + k; }

// Index of (b, c, d, n) in a (B, C, D, N) chunk tensor.
fn cidx(b: u32, c: u32, d: u32, n: u32) -> u32 {
    return ((b * p.C + c) * p.D + d) * p.N + n;
}

// Av, rA of this lane (A = -1 in padded lanes, whose Bs = Cs = 0 keep them at zero).
fn load_a(l: Lane) {
    for (var q = 0u; q < 4u; q++) {
        var a = vec4<f32>(-1.0);
        for (var k = 0u; k < 4u; k++) {
            let n = state_of(l, q, k);
            if (l.on && q < NV && n < p.N) { a[k] = a_of(w[p.alog_off + l.d * p.N + n]); }
        }
        Av[q] = a;
        rA[q] = 1.0 / a;
    }
}

// (BCMAX,) this invocation's share of the next block's Bs | Cs, element e = li + k WG of
// the block's TS * 32 SG floats (the host keeps TS * 32 SG <= BCMAX * WG).
const BCMAX: u32 = 32u;
var<private> nbc: array<f32, BCMAX>;

// Load this invocation's share of Bs, Cs of steps [tb, te) of batch row b into nbc.
fn fetch_bc(li: u32, b: u32, tb: u32, te: u32) {
    let per = 32u * SG;                       // floats per step
    for (var k = 0u; k < BCMAX; k++) {
        let e = li + k * WG;
        if (e < TS * per) {
            let ts = e / per;
            let wsel = (e % per) / (16u * SG);    // 0 = Bs, 1 = Cs
            let n = e % (16u * SG);
            var v = 0.0;
            if (tb + ts < te && n < p.N) { v = xproj[(b * p.L + tb + ts) * p.P + p.R + wsel * p.N + n]; }
            nbc[k] = v;
        }
    }
}

// Store nbc into buffer buf of bc (the other buffer is being read: a barrier after).
fn store_bc(li: u32, buf: u32) {
    let per = 32u * SG;
    for (var k = 0u; k < BCMAX; k++) {
        let e = li + k * WG;
        if (e < TS * per) {
            let ts = e / per;
            let wsel = (e % per) / (16u * SG);
            let n = e % (16u * SG);
            bc[(((buf * TS + ts) * 2u + wsel) * SG + n / 16u) * 4u + (n % 16u) / 4u][n % 4u] = nbc[k];
        }
    }
}

fn bc_at(buf: u32, ts: u32, wsel: u32, s: u32, q: u32) -> vec4<f32> {
    return bc[(((buf * TS + ts) * 2u + wsel) * SG + s) * 4u + q];
}

// (TSMAX,) each: delta_pre, u, dy and y (scan_forward_correct) of the next block's steps
// (n_) and of the block being run (c_), rows of (M, D) (values past the chunk's end are not
// read).
var<private> n_dp: array<f32, TSMAX>;
var<private> n_u: array<f32, TSMAX>;
var<private> n_dy: array<f32, TSMAX>;
var<private> n_y: array<f32, TSMAX>;
var<private> c_dp: array<f32, TSMAX>;
var<private> c_u: array<f32, TSMAX>;
var<private> c_dy: array<f32, TSMAX>;
var<private> c_y: array<f32, TSMAX>;

// Load delta_pre (n_dp), u (n_u), dy (n_dy) or y (n_y) of steps [tb, min(tb + TS, te))
// (four functions: an entry point binds only the buffers it reads).
fn fetch_dp(l: Lane, tb: u32, te: u32) {
    for (var ts = 0u; ts < TSMAX; ts++) {
        if (ts < TS && l.on && tb + ts < te) { n_dp[ts] = delta_pre[(l.b * p.L + tb + ts) * p.D + l.d]; }
    }
}

fn fetch_u(l: Lane, tb: u32, te: u32) {
    for (var ts = 0u; ts < TSMAX; ts++) {
        if (ts < TS && l.on && tb + ts < te) { n_u[ts] = u[(l.b * p.L + tb + ts) * p.D + l.d]; }
    }
}

fn fetch_dy(l: Lane, tb: u32, te: u32) {
    for (var ts = 0u; ts < TSMAX; ts++) {
        if (ts < TS && l.on && tb + ts < te) { n_dy[ts] = dy[(l.b * p.L + tb + ts) * p.D + l.d]; }
    }
}

fn fetch_y(l: Lane, tb: u32, te: u32) {
    for (var ts = 0u; ts < TSMAX; ts++) {
        if (ts < TS && l.on && tb + ts < te) { n_y[ts] = y[(l.b * p.L + tb + ts) * p.D + l.d]; }
    }
}

// The loads every walk issues for a block: its Bs | Cs share and delta_pre.
fn fetch_block(l: Lane, li: u32, tb: u32, te: u32) {
    fetch_bc(li, l.b, tb, te);
    fetch_dp(l, tb, te);
}

// Start a block: the staged per-step inputs become the current ones (the caller then
// issues the next block's loads).
fn rotate() {
    c_dp = n_dp;
    c_u = n_u;
    c_dy = n_dy;
    c_y = n_y;
}

// ZOH / Euler input factor coef = b_t / Bs_t of register q (ex = exp(x), x = delta A).
fn coef_of(q: u32, x: vec4<f32>, ex: vec4<f32>, dl: f32) -> vec4<f32> {
    if (p.zoh == 1u) { return expm1_v4(x, ex) * rA[q]; }
    return vec4<f32>(dl);
}

// Decay product prod a_t of the chunk (scan_forward_chunk).
var<private> acp: array<vec4<f32>, 4>;

// The factors of one step of register q at step size dl: h_t = a_t h_{t-1} + coef_t b_t u_t.
struct Factors { a: vec4<f32>, coef: vec4<f32> }   // a_t = exp(delta A); coef_t (coef_of)

fn factors_of(q: u32, dl: f32) -> Factors {
    let x = dl * Av[q];
    let ex = exp(x);
    return Factors(ex, coef_of(q, x, ex, dl));
}

// hv[q] one step on (bs: b_t of register q, uu: u_t).
fn advance(q: u32, f: Factors, bs: vec4<f32>, uu: f32) {
    hv[q] = fma(f.a, hv[q], f.coef * bs * uu);
}

// One step of the recurrence on hv (staged step ts of buffer buf); ``track``: also
// acp *= a_t.
fn step_h(l: Lane, buf: u32, ts: u32, dl: f32, uu: f32, track: bool) {
    for (var q = 0u; q < 4u; q++) {
        if (q < NV) {
            let f = factors_of(q, dl);
            advance(q, f, bc_at(buf, ts, 0u, l.s, q), uu);
            if (track) { acp[q] *= f.a; }
        }
    }
}

const NONE: u32 = 0xffffffffu;

// Index of this lane's state (q, k) in a (B, C, D, N) chunk tensor, NONE when padded.
fn ck_index(l: Lane, q: u32, k: u32) -> u32 {
    let n = state_of(l, q, k);
    if (!l.on || q >= NV || n >= p.N) { return NONE; }
    return cidx(l.b, l.c, l.d, n);
}

// ---------------------------------------------------------------- forward
// y of the block's steps where SG > 1: the sums over each channel's state groups of ysum
// (fixed order), written as y = sum + D_vec u (scan_forward_chunk) or added to y
// (scan_forward_correct); a barrier before (ysum complete), none after.
fn y_group_sums(l: Lane, li: u32, tb: u32, t1: u32, dvec: f32, add: bool) {
    workgroupBarrier();
    for (var ts = 0u; ts < TS; ts++) {
        if (l.on && l.s == 0u && tb + ts < t1) {
            var ys = 0.0;
            for (var j = 0u; j < SG; j++) { ys += ysum[ts * WG + li + j]; }
            let r = (l.b * p.L + tb + ts) * p.D + l.d;
            if (add) { y[r] += ys; } else { y[r] = ys + dvec * u[r]; }
        }
    }
}

@compute @workgroup_size(WG)
fn scan_forward_chunk(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let l = lane(li, wid);
    let t0 = wid.y * p.chunk;                 // uniform bounds: barriers inside are fine
    let t1 = min(t0 + p.chunk, p.L);
    load_a(l);
    for (var q = 0u; q < 4u; q++) { hv[q] = vec4<f32>(0.0); acp[q] = vec4<f32>(1.0); }
    let dvec = select(0.0, w[p.dvec_off + min(l.d, p.D - 1u)], l.on);
    fetch_bc(li, l.b, t0, t1);
    store_bc(li, 0u);
    workgroupBarrier();
    for (var tb = t0; tb < t1; tb += TS) {
        let buf = ((tb - t0) / TS) % 2u;
        if (tb + TS < t1) { fetch_bc(li, l.b, tb + TS, t1); }
        for (var ts = 0u; ts < TS; ts++) {
            var yv = 0.0;
            let r = (l.b * p.L + tb + ts) * p.D + l.d;
            if (l.on && tb + ts < t1) {
                let uu = u[r];
                step_h(l, buf, ts, softplus(delta_pre[r]), uu, true);
                for (var q = 0u; q < 4u; q++) {
                    if (q < NV) { yv += dot(bc_at(buf, ts, 1u, l.s, q), hv[q]); }
                }
                if (SG == 1u) { y[r] = yv + dvec * uu; }
            }
            if (SG > 1u) { ysum[ts * WG + li] = yv; }
        }
        if (SG > 1u) { y_group_sums(l, li, tb, t1, dvec, false); }
        if (tb + TS < t1) { store_bc(li, 1u - buf); }
        workgroupBarrier();
    }
    if (p.C > 1u) {                            // (one chunk: y is all there is)
        for (var q = 0u; q < 4u; q++) {
            for (var k = 0u; k < 4u; k++) {
                let i = ck_index(l, q, k);
                if (i != NONE) { hchunk[i] = hv[q][k]; achunk[i] = acp[q][k]; }
            }
        }
    }
}

@compute @workgroup_size(WG)
fn scan_forward_carry(@builtin(local_invocation_index) li: u32,
                      @builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    let DN = p.D * p.N;
    if (i >= p.B * DN) { return; }
    let b = i / DN;
    let dn = i % DN;
    var h = 0.0;
    var c = 0u;
    for (; c + 4u <= p.C; c += 4u) {          // four chunks' loads issued before their use
        let k = (b * p.C + c) * DN + dn;
        let a = vec4<f32>(achunk[k], achunk[k + DN], achunk[k + 2u * DN], achunk[k + 3u * DN]);
        let x = vec4<f32>(hchunk[k], hchunk[k + DN], hchunk[k + 2u * DN], hchunk[k + 3u * DN]);
        hstate[k] = h;
        h = a.x * h + x.x;
        hstate[k + DN] = h;
        h = a.y * h + x.y;
        hstate[k + 2u * DN] = h;
        h = a.z * h + x.z;
        hstate[k + 3u * DN] = h;
        h = a.w * h + x.w;
    }
    for (; c < p.C; c++) {
        let k = (b * p.C + c) * DN + dn;
        hstate[k] = h;
        h = achunk[k] * h + hchunk[k];
    }
}

// Grid (G, C - 1, B): chunk c = 1 + workgroup y (chunk 0 starts from zero: nothing to add).
@compute @workgroup_size(WG)
fn scan_forward_correct(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let l = lane(li, vec3<u32>(wid.x, wid.y + 1u, wid.z));
    let t0 = (wid.y + 1u) * p.chunk;          // (from wid: uniform bounds for the barriers)
    let t1 = min(t0 + p.chunk, p.L);
    load_a(l);
    for (var q = 0u; q < 4u; q++) {
        hv[q] = vec4<f32>(0.0);
        for (var k = 0u; k < 4u; k++) {
            let i = ck_index(l, q, k);
            if (i != NONE) { hv[q][k] = hstate[i]; }
        }
    }
    var S = 0.0;                               // sum of delta over the chunk's steps so far
    // (delta_pre and, with one state group, y of the next block loaded while this one runs)
    fetch_block(l, li, t0, t1);
    if (SG == 1u) { fetch_y(l, t0, t1); }
    store_bc(li, 0u);
    workgroupBarrier();
    for (var tb = t0; tb < t1; tb += TS) {
        let buf = ((tb - t0) / TS) % 2u;
        rotate();
        if (tb + TS < t1) {
            fetch_block(l, li, tb + TS, t1);
            if (SG == 1u) { fetch_y(l, tb + TS, t1); }
        }
        for (var ts = 0u; ts < TS; ts++) {
            var yv = 0.0;
            let r = (l.b * p.L + tb + ts) * p.D + l.d;
            if (l.on && tb + ts < t1) {
                S += softplus(c_dp[ts]);
                for (var q = 0u; q < 4u; q++) {
                    if (q < NV) { yv += dot(bc_at(buf, ts, 1u, l.s, q), exp(Av[q] * S) * hv[q]); }
                }
                if (SG == 1u) { y[r] = c_y[ts] + yv; }
            }
            if (SG > 1u) { ysum[ts * WG + li] = yv; }
        }
        if (SG > 1u) { y_group_sums(l, li, tb, t1, 0.0, true); }
        if (tb + TS < t1) { store_bc(li, 1u - buf); }
        workgroupBarrier();
    }
}

// --------------------------------------------------------------- backward
@compute @workgroup_size(WG)
fn scan_backward_chunk(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let l = lane(li, wid);
    let t0 = wid.y * p.chunk;
    let t1 = min(t0 + p.chunk, p.L);
    let nblk = (t1 - t0 + TS - 1u) / TS;
    load_a(l);
    var an: array<vec4<f32>, 4>;              // a_{t+1} of the step after t (0 past the chunk)
    for (var q = 0u; q < 4u; q++) { hv[q] = vec4<f32>(0.0); an[q] = vec4<f32>(0.0); }
    let tl = t0 + (nblk - 1u) * TS;           // the last block
    fetch_block(l, li, tl, t1); fetch_dy(l, tl, t1);
    store_bc(li, 0u);
    workgroupBarrier();
    for (var jj = 0u; jj < nblk; jj++) {      // blocks from the last
        let tb = tl - jj * TS;
        let buf = jj % 2u;
        rotate();
        if (jj + 1u < nblk) { fetch_block(l, li, tb - TS, t1); fetch_dy(l, tb - TS, t1); }
        for (var k = 0u; k < TS; k++) {
            let ts = TS - 1u - k;
            if (l.on && tb + ts < t1) {
                let dyv = c_dy[ts];
                let dl = softplus(c_dp[ts]);
                for (var q = 0u; q < 4u; q++) {
                    if (q < NV) {
                        hv[q] = fma(an[q], hv[q], bc_at(buf, ts, 1u, l.s, q) * dyv);
                        an[q] = exp(dl * Av[q]);
                    }
                }
            }
        }
        if (jj + 1u < nblk) { store_bc(li, 1u - buf); }
        workgroupBarrier();
    }
    for (var q = 0u; q < 4u; q++) {
        for (var k = 0u; k < 4u; k++) {
            let i = ck_index(l, q, k);
            if (i != NONE) { gchunk[i] = an[q][k] * hv[q][k]; }
        }
    }
}

@compute @workgroup_size(WG)
fn scan_backward_carry(@builtin(local_invocation_index) li: u32,
                       @builtin(workgroup_id) wid: vec3<u32>,
                       @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    let DN = p.D * p.N;
    if (i >= p.B * DN) { return; }
    let b = i / DN;
    let dn = i % DN;
    var k = 0.0;
    var c = p.C;
    for (; c >= 4u; c -= 4u) {                // four chunks' loads issued before their use
        let j = (b * p.C + c - 1u) * DN + dn;
        let x = vec4<f32>(gchunk[j], gchunk[j - DN], gchunk[j - 2u * DN], gchunk[j - 3u * DN]);
        let a = vec4<f32>(achunk[j], achunk[j - DN], achunk[j - 2u * DN], achunk[j - 3u * DN]);
        gcarry[j] = k;
        k = x.x + a.x * k;
        gcarry[j - DN] = k;
        k = x.y + a.y * k;
        gcarry[j - 2u * DN] = k;
        k = x.z + a.z * k;
        gcarry[j - 3u * DN] = k;
        k = x.w + a.w * k;
    }
    for (; c > 0u; c--) {
        let j = (b * p.C + c - 1u) * DN + dn;
        gcarry[j] = k;
        k = gchunk[j] + achunk[j] * k;
    }
}

// scan_backward_grads keeps its per-block values in module-scope private arrays and runs
// the steps of a block as calls with a constant step index (pass2_load/pass2_recompute/
// pass2_back(l, .., 0u), (.., 1u), ...), not as loops, as linear.wgsl's `mac`: the
// arrays are then indexed by constants (registers) wherever the compiler does not unroll
// loops. Same results bit for bit; lavapipe runs the kernel 2x faster, an H200 1.5-3.5%.
// The steps backward take h_{t-1}, h_t, exp(delta A) and coef from the block's recomputation
// (as the CPU core's backward takes them from its recomputed chunk) rather than computing
// the exponentials again: ~24 of ~69 instructions per state and step.
var<private> hist: array<vec4<f32>, 4u * TSMAX>;   // (TSMAX, 4): h_{t-1} of the block's steps
var<private> hex: array<vec4<f32>, 4u * TSMAX>;    // (TSMAX, 4): a_t = exp(delta A)
var<private> hco: array<vec4<f32>, 4u * TSMAX>;    // (TSMAX, 4): coef_t (coef_of)
var<private> gc: array<vec4<f32>, 4>;              // carry a_{t+1} g_{t+1}
var<private> dA: array<vec4<f32>, 4>;              // dLoss/dA summed over the chunk
var<private> b_dl: array<f32, TSMAX>;              // the block's delta and sigmoid(delta_pre)
var<private> b_sg: array<f32, TSMAX>;              // (the softplus backward)

// One step of the adjoint recurrence on the carry of register q: g_t = Cs_t dy_t +
// a_{t+1} g_{t+1}, returned, and the carry becomes a_t g_t (ex = a_t). Both walks of
// scan_backward_grads take it, so its second meets the first one's checkpoints bit for bit.
fn adjoint_step(q: u32, ex: vec4<f32>, cs: vec4<f32>, dyv: f32) -> vec4<f32> {
    let g = fma(cs, vec4<f32>(dyv), gc[q]);
    gc[q] = ex * g;
    return g;
}

// Where a block of TS steps starts (tb), where its chunk ends (t1), its buffer of bc,
// and what pass 2 needs.
struct Blk { tb: u32, t1: u32, buf: u32, dvec: f32, gx: u32 }

// Step ts's delta and softplus derivative, from the block's staged delta_pre.
fn pass2_load(l: Lane, bk: Blk, ts: u32) {
    if (ts < TS && l.on && bk.tb + ts < bk.t1) {
        b_dl[ts] = softplus(c_dp[ts]);
        b_sg[ts] = sigmoid(c_dp[ts]);
    }
}

// Step ts forward again from hv (step_h's step), keeping h_{t-1}, a_t and coef_t.
fn pass2_recompute(l: Lane, bk: Blk, ts: u32) {
    if (ts < TS && l.on && bk.tb + ts < bk.t1) {
        for (var q = 0u; q < 4u; q++) {
            if (q < NV) {
                let f = factors_of(q, b_dl[ts]);
                hist[ts * 4u + q] = hv[q];
                hex[ts * 4u + q] = f.a;
                hco[ts * 4u + q] = f.coef;
                advance(q, f, bc_at(bk.buf, ts, 0u, l.s, q), c_u[ts]);
            }
        }
    }
}

// Step ts backward (the block's steps run from ts = TS - 1 down); its dBs | dCs (and, with
// SG > 1, du and ddelta) go to sum_step (scan_sums_workgroup.wgsl or scan_sums_subgroup.wgsl,
// the host's choice; barriers and shuffles in it: the calls are uniform, ts a constant and
// the rest per workgroup).
fn pass2_back(l: Lane, li: u32, bk: Blk, ts: u32) {
    if (ts >= TS) { return; }
    let tb = bk.tb;
    let t1 = bk.t1;
    let dvec = bk.dvec;
    let t = tb + ts;
    var db: array<vec4<f32>, 4>;
    var dc: array<vec4<f32>, 4>;
    var sdu = 0.0;
    var sdd = 0.0;
    if (l.on && t < t1) {
        let r = (l.b * p.L + t) * p.D + l.d;
        let dl = b_dl[ts];
        let uu = c_u[ts];
        let dyv = c_dy[ts];
        for (var q = 0u; q < 4u; q++) {
            if (q < NV) {
                let A = Av[q];
                let ex = hex[ts * 4u + q];
                let coef = hco[ts * 4u + q];
                let Bq = bc_at(bk.buf, ts, 0u, l.s, q);
                let Cq = bc_at(bk.buf, ts, 1u, l.s, q);
                let hp = hist[ts * 4u + q];
                let g = adjoint_step(q, ex, Cq, dyv);
                let gbu = g * (Bq * uu);           // dLoss/dcoef
                let ghe = gc[q] * hp;              // dLoss/da_t * a_t (gc = a_t g_t)
                sdu += dot(g * coef, Bq);
                db[q] = g * coef * uu;
                // h_t: the next step's h_{t-1}, or hv after the block's last step
                let nx = min(ts + 1u, TSMAX - 1u) * 4u + q;
                dc[q] = dyv * select(hist[nx], hv[q], ts + 1u >= TS || t + 1u >= t1);
                if (p.zoh == 1u) {
                    // dcoef/dA = (delta a_t - coef) / A (the CPU core's form: next to the
                    // delta a_t term it loses ~eps of the sum, measured at float32 rounding)
                    sdd += dot(ghe, A) + dot(gbu, ex);
                    dA[q] += ghe * dl + gbu * (fma(vec4<f32>(dl), ex, -coef) * rA[q]);
                } else {
                    sdd += dot(ghe, A) + dot(gbu, vec4<f32>(1.0));
                    dA[q] += ghe * dl;
                }
            }
        }
        if (SG == 1u) {
            du[r] = sdu + dvec * dyv;
            ddelta_pre[r] = sdd * b_sg[ts];
        }
    }
    sum_step(l, li, bk, ts, db, dc, sdu, sdd);
}

@compute @workgroup_size(WG)
fn scan_backward_grads(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let l = lane(li, wid);
    let t0 = wid.y * p.chunk;
    let t1 = min(t0 + p.chunk, p.L);
    let nblk = (t1 - t0 + TS - 1u) / TS;
    load_a(l);
    var gblock: array<vec4<f32>, 4u * CKMAX>;    // (CKMAX, 4): carry into each block's last step
    for (var q = 0u; q < 4u; q++) {
        hv[q] = vec4<f32>(0.0); gc[q] = vec4<f32>(0.0); dA[q] = vec4<f32>(0.0);
    }
    for (var q = 0u; q < 4u; q++) {
        for (var k = 0u; k < 4u; k++) {
            let i = ck_index(l, q, k);
            if (i != NONE && l.c > 0u) { hv[q][k] = hstate[i]; }
            if (i != NONE && l.c + 1u < p.C) { gc[q][k] = gcarry[i]; }
        }
    }
    // 1. walk the chunk backward from its carry, keeping the carry a_{t+1} g_{t+1} into the
    // last step of each block (g needs no input factor: a third of the work of a walk of h)
    fetch_block(l, li, t0 + (nblk - 1u) * TS, t1); fetch_dy(l, t0 + (nblk - 1u) * TS, t1);
    store_bc(li, 0u);
    workgroupBarrier();
    for (var jj = 0u; jj < nblk; jj++) {
        let j = nblk - 1u - jj;
        let tb = t0 + j * TS;
        let buf = jj % 2u;
        rotate();
        if (j > 0u) { fetch_block(l, li, tb - TS, t1); fetch_dy(l, tb - TS, t1); }
        if (l.on) {
            for (var q = 0u; q < 4u; q++) { gblock[j * 4u + q] = gc[q]; }
            for (var k = 0u; k < TS; k++) {
                let ts = TS - 1u - k;
                if (tb + ts < t1) {
                    let dl = softplus(c_dp[ts]);
                    let dyv = c_dy[ts];
                    for (var q = 0u; q < 4u; q++) {
                        if (q < NV) {
                            adjoint_step(q, exp(dl * Av[q]), bc_at(buf, ts, 1u, l.s, q), dyv);
                        }
                    }
                }
            }
        }
        if (j > 0u) { store_bc(li, 1u - buf); }
        workgroupBarrier();
    }
    let dvec = select(0.0, w[p.dvec_off + min(l.d, p.D - 1u)], l.on);
    // 2. the blocks in order, the state carried from one to the next: recompute the block's
    // states into registers, then its steps backward from the block's carry (TS <= TSMAX = 8;
    // the calls past TS return at once). The next block's Bs | Cs are stored before the
    // block's last step, then a barrier (the workgroup sums' last one, TS % RB == 0).
    fetch_block(l, li, t0, t1); fetch_u(l, t0, t1); fetch_dy(l, t0, t1);
    store_bc(li, 0u);
    workgroupBarrier();
    for (var j = 0u; j < nblk; j++) {
        let bk = Blk(t0 + j * TS, t1, j % 2u, dvec, wid.x);
        rotate();
        if (j + 1u < nblk) {
            fetch_block(l, li, bk.tb + TS, t1); fetch_u(l, bk.tb + TS, t1); fetch_dy(l, bk.tb + TS, t1);
        }
        pass2_load(l, bk, 0u); pass2_load(l, bk, 1u); pass2_load(l, bk, 2u); pass2_load(l, bk, 3u);
        pass2_load(l, bk, 4u); pass2_load(l, bk, 5u); pass2_load(l, bk, 6u); pass2_load(l, bk, 7u);
        if (l.on) { for (var q = 0u; q < 4u; q++) { gc[q] = gblock[j * 4u + q]; } }
        pass2_recompute(l, bk, 0u); pass2_recompute(l, bk, 1u); pass2_recompute(l, bk, 2u);
        pass2_recompute(l, bk, 3u); pass2_recompute(l, bk, 4u); pass2_recompute(l, bk, 5u);
        pass2_recompute(l, bk, 6u); pass2_recompute(l, bk, 7u);
        pass2_back(l, li, bk, 7u); pass2_back(l, li, bk, 6u); pass2_back(l, li, bk, 5u);
        pass2_back(l, li, bk, 4u); pass2_back(l, li, bk, 3u); pass2_back(l, li, bk, 2u);
        pass2_back(l, li, bk, 1u);
        if (j + 1u < nblk) { store_bc(li, 1u - bk.buf); }
        pass2_back(l, li, bk, 0u);
        if (SUB > 0u) { workgroupBarrier(); }   // (the workgroup sums end in one)
    }
    for (var q = 0u; q < 4u; q++) {
        for (var k = 0u; k < 4u; k++) {
            let i = ck_index(l, q, k);
            if (i != NONE) { da_part[i] = dA[q][k]; }
        }
    }
}

// s + v.x + v.y + v.z + v.w added in that order, a plain loop's (the sums below load four
// values before they add them: the same bits as adding each as it comes).
fn add_in_order(s: f32, v: vec4<f32>) -> f32 { return (((s + v.x) + v.y) + v.z) + v.w; }

@compute @workgroup_size(WG)
fn scan_backward_sum_bc(@builtin(local_invocation_index) li: u32,
                        @builtin(workgroup_id) wid: vec3<u32>,
                        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    let M = p.B * p.L;
    let W = 2u * p.N;
    if (i >= M * W) { return; }
    let r = i / W;
    let j = i % W;
    var s = 0.0;
    var g = 0u;
    let MW = M * W;
    for (; g + 4u <= p.G; g += 4u) {          // four loads in flight, added in order
        let v = vec4<f32>(dbc_part[g * MW + i], dbc_part[(g + 1u) * MW + i],
                          dbc_part[(g + 2u) * MW + i], dbc_part[(g + 3u) * MW + i]);
        s = add_in_order(s, v);
    }
    for (; g < p.G; g++) { s += dbc_part[g * MW + i]; }
    dxproj[r * p.P + p.R + j] = s;
}

// (8, 32) scan_backward_sum_a_log's lane sums, lane q of column j at q * 32 + j.
var<workgroup> alog_sums: array<f32, 256>;

// dA_log of 32 (d, n) columns of da_part (B C, D N) per (32, 8) workgroup: lane q sums the
// rows q, q + 8, ..., then the 8 lane sums are added in the order q = 0..7 (a fixed order;
// 8 lanes a column so that a few hundred columns still keep the GPU busy).
@compute @workgroup_size(32, 8)
fn scan_backward_sum_a_log(@builtin(local_invocation_id) lid: vec3<u32>,
                           @builtin(workgroup_id) wid: vec3<u32>,
                           @builtin(num_workgroups) nwg: vec3<u32>) {
    let DN = p.D * p.N;
    let i = (wid.y * nwg.x + wid.x) * 32u + lid.x;
    var s = 0.0;
    if (i < DN) {
        let n = p.B * p.C;
        var q = lid.y;
        for (; q + 24u < n; q += 32u) {       // four loads in flight, added in order
            let v = vec4<f32>(da_part[q * DN + i], da_part[(q + 8u) * DN + i],
                              da_part[(q + 16u) * DN + i], da_part[(q + 24u) * DN + i]);
            s = add_in_order(s, v);
        }
        for (; q < n; q += 8u) { s += da_part[q * DN + i]; }
    }
    alog_sums[lid.y * 32u + lid.x] = s;
    workgroupBarrier();
    if (lid.y == 0u && i < DN) {
        var tot = 0.0;
        for (var q = 0u; q < 8u; q++) { tot += alog_sums[q * 32u + lid.x]; }
        let a_log = w[p.alog_off + i];
        // Closed clamp: exactly zero gradient at and beyond the bounds.
        if (a_log > a_log_min && a_log < a_log_max) {
            grad[p.alog_off + i] = grad[p.alog_off + i] + a_of(a_log) * tot;
        }
    }
}
