// conv1d.wgsl — depthwise causal convolution over time, fused with SiLU. The
// GPU side of mamba_ext/cpu/conv1d.pyx. common.wgsl is prepended by the loader.
//
// Size letters: B batch, L seqLen, D dInner, K dConv, M = B*L rows, T rows per tile,
// G = ceil(D / 64) channel groups.
//
//   conv[b,t,d] = bConv[d] + sum_{k<K, t-k>=0} wConv[d,k] * xc[b,t-k,d],  u = SiLU(conv)
//   (tap k = 0 is the current step; xc = in_proj columns 0..D of Y). conv is not
//   stored: the backward recomputes it from Y (K taps, the same sum: no (M, D) buffer).
//   Backward: dconv = du * SiLU'(conv), dxc[t] = sum_{k<K, t+k<L} wConv[d,k] dconv[t+k],
//   dwConv[d,k] = sum_t dconv[t] xc[t-k] (t-k >= 0), dbConv[d] = sum_t dconv[t].
//
// Design: every invocation runs one channel over a tile of T consecutive rows, the rows
// it reads held in registers (yv: xc from K-1 rows before the tile to K-1 rows after it;
// dc: dconv of the tile and the K-1 rows after it), so each input is loaded once per tile
// and dconv is never stored (the K-1 rows past a tile are recomputed by the next one).
// Workgroups of 256 invocations: 64 channels (lx, consecutive in memory: coalesced) x 4
// tiles (ly); the workgroup index (flattened, flat_index's grid) = channel group + G x
// tile group (forward) or row block (backward). K and T are override constants (the host
// keeps T + 2 (K - 1) <= WMAX), so the tile loops unroll and the arrays stay in registers.
//
// Y holds f32 values or, with HALF, f16 pairs (two per word, element e in half e % 2: the
// f16 mode's cache, read where it is used instead of unpacked into an f32 copy).
//
// Bindings, conv1d_forward (tiles of T rows, four per workgroup):
// | binding | name | shape   | access                                                 |
// |---------|------|---------|--------------------------------------------------------|
// | 0       | p    | Params  | uniform                                                |
// | 1       | Y    | (M, 2D) | read: in_proj output; xc = Y[:, 0:D] (row stride y_rs; f32 or f16) |
// | 2       | w    | (..)    | read: parameter arena, wConv (D, K) at w_off, bConv (D) at b_off |
// | 3       | u    | (M, D)  | read_write: SiLU(conv), the scan input                  |
// conv1d_backward (row block rb = rows [rb rows_per, (rb + 1) rows_per), its tiles taken
// by the four ly in turn; dwConv, dbConv summed per invocation, then over ly in a fixed
// order into part) and conv1d_backward_weight_final (one invocation per (k, d): adds the
// RB partials in the order rb = 0..RB-1): no atomics, fixed summation order.
// | 1       | Y    | (M, 2D) | read: xc columns                                        |
// | 2       | w    | (..)    | read: parameter arena                                  |
// | 3       | du   | (M, D)  | read: dLoss/du (scan path + x_proj path)                |
// | 4       | dY   | (M, 2D) | backward: write dY[:, 0:D] = dxc                        |
// | 5       | part | (RB, K+1, D) | backward: write; final: read (k = K: the bias)     |
// | 6       | g    | (..)    | final: read_write: gradient arena, wConv at w_off, bConv at b_off (+=) |

struct Params { M: u32, L: u32, D: u32, K: u32, y_rs: u32, w_off: u32, b_off: u32,
                rows_per: u32, RB: u32 }

override K: u32 = 4u;         // dConv (= p.K)
override T: u32 = 16u;        // rows per tile
override HALF: bool = false;  // Y as f16 pairs
const WMAX: u32 = 48u;        // register window: T + 2 (K - 1) <= WMAX
const KMAX: u32 = 24u;        // taps in registers (K <= KMAX follows from the window)

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> Y: array<u32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;

// (WMAX,) xc of rows r0 - (K-1) + i of channel d (0 outside [0, M)); (KMAX,) wConv[d, :].
var<private> yv: array<f32, WMAX>;
var<private> wk: array<f32, KMAX>;

// Load the taps of channel d and the window of a tile starting at row r0 with ``after``
// rows past its T (K - 1 for the backward, 0 for the forward).
fn load_window(d: u32, r0: u32, after: u32) {
    for (var k = 0u; k < KMAX; k++) {
        if (k < K) { wk[k] = w[p.w_off + d * K + k]; }
    }
    for (var i = 0u; i < WMAX; i++) {
        if (i < T + K - 1u + after) {
            let r = r0 + i;                 // row r - (K - 1)
            var v = 0.0;
            if (r >= K - 1u && r - (K - 1u) < p.M) {
                let e = (r - (K - 1u)) * p.y_rs + d;
                v = act_value(Y[act_word(e, HALF)], e, HALF);
            }
            yv[i] = v;
        }
    }
}

// conv (before SiLU) of the tile's row j (t = its time step): bConv + taps from k = 0
// up, as the CPU sums them.
fn conv_of(d: u32, j: u32, t: u32) -> f32 {
    var s = w[p.b_off + d];
    for (var k = 0u; k < KMAX; k++) {
        if (k < K && k <= t) { s += wk[k] * yv[j + K - 1u - k]; }
    }
    return s;
}

// This workgroup's channel group (x: channels 64 x .. 64 x + 63) and its place along the
// rows (y: the forward's group of four tiles, the backward's row block), from the
// flattened grid (flat_index's split).
fn wg_place(wid: vec3<u32>, nwg: vec3<u32>) -> vec2<u32> {
    let G = (p.D + 63u) / 64u;
    let wf = wid.y * nwg.x + wid.x;
    return vec2<u32>(wf % G, wf / G);
}

@group(0) @binding(3) var<storage, read_write> f_u: array<f32>;

@compute @workgroup_size(256)
fn conv1d_forward(@builtin(local_invocation_index) li: u32,
                  @builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>) {
    let pl = wg_place(wid, nwg);
    let d = pl.x * 64u + li % 64u;
    let r0 = (pl.y * 4u + li / 64u) * T;
    if (d >= p.D || r0 >= p.M) { return; }
    load_window(d, r0, 0u);
    for (var j = 0u; j < WMAX; j++) {
        let r = r0 + j;
        if (j < T && r < p.M) { f_u[r * p.D + d] = silu(conv_of(d, j, r % p.L)); }
    }
}

@group(0) @binding(3) var<storage, read> b_du: array<f32>;
@group(0) @binding(4) var<storage, read_write> b_dY: array<f32>;
@group(0) @binding(5) var<storage, read_write> b_part: array<f32>;
@group(0) @binding(6) var<storage, read_write> b_g: array<f32>;

// (WMAX,) dconv of rows r0 + i (0 past M); (KMAX + 1,) this invocation's sums of dwConv
// (k < K) and dbConv (k = K).
var<private> dc: array<f32, WMAX>;
var<private> acc: array<f32, KMAX + 1u>;
// (4, 64) one tap's sums of the workgroup's four ly, summed in the order ly = 0..3.
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn conv1d_backward(@builtin(local_invocation_index) li: u32,
                   @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>) {
    let pl = wg_place(wid, nwg);
    let rb = pl.y;                              // uniform per workgroup: barriers below
    let d = pl.x * 64u + li % 64u;
    let on = d < p.D && rb < p.RB;
    let r1 = min(p.M, (rb + 1u) * p.rows_per);
    for (var k = 0u; k <= KMAX; k++) { acc[k] = 0.0; }
    if (on) {
        for (var r0 = rb * p.rows_per + (li / 64u) * T; r0 < r1; r0 += 4u * T) {
            load_window(d, r0, K - 1u);
            for (var i = 0u; i < WMAX; i++) {
                let r = r0 + i;
                if (i < T + K - 1u) {
                    var v = 0.0;
                    if (r < p.M) { v = b_du[r * p.D + d] * dsilu(conv_of(d, i, r % p.L)); }
                    dc[i] = v;
                }
            }
            for (var j = 0u; j < WMAX; j++) {
                let r = r0 + j;
                if (j < T && r < r1) {
                    let t = r % p.L;
                    var s = 0.0;
                    for (var k = 0u; k < KMAX; k++) {
                        if (k < K && t + k < p.L) { s += wk[k] * dc[j + k]; }
                        if (k < K && k <= t) { acc[k] += dc[j] * yv[j + K - 1u - k]; }
                    }
                    acc[K] += dc[j];
                    b_dY[r * p.y_rs + d] = s;
                }
            }
        }
    }
    for (var k = 0u; k <= KMAX; k++) {
        if (k <= K) {
            red[li] = acc[k];
            workgroupBarrier();
            if (li < 64u && on) {
                let s = ((red[li] + red[li + 64u]) + red[li + 128u]) + red[li + 192u];
                b_part[(rb * (K + 1u) + k) * p.D + d] = s;
            }
            workgroupBarrier();
        }
    }
}

@compute @workgroup_size(256)
fn conv1d_backward_weight_final(@builtin(local_invocation_index) li: u32,
                                @builtin(workgroup_id) wid: vec3<u32>,
                                @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = flat_index(wid, nwg, li, 256u);
    if (e >= (K + 1u) * p.D) { return; }
    let k = e / p.D;
    let d = e % p.D;
    var s = 0.0;
    for (var rb = 0u; rb < p.RB; rb++) { s += b_part[(rb * (K + 1u) + k) * p.D + d]; }
    var o = p.w_off + d * K + k;
    if (k == K) { o = p.b_off + d; }
    b_g[o] = b_g[o] + s;
}
