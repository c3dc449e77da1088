// conv1d.wgsl — depthwise causal convolution over time, fused with SiLU. The
// GPU side of mamba_ext/cpu/conv1d.pyx. common.wgsl is prepended by the loader.
//
// Size letters: B batch, L seqLen, D dInner, K dConv, M = B*L rows, RPI rows per
// invocation, G = ceil(D / 64) channel groups.
//
//   conv[b,t,d] = bConv[d] + sum_{k<K, t-k>=0} wConv[d,k] * xc[b,t-k,d],  u = SiLU(conv)
//   (tap k = 0 is the current step; xc = in_proj columns 0..D of Y). conv is not
//   stored: the backward recomputes it from Y (K taps, the same sum: no (M, D) buffer).
//   Backward: dconv = du * SiLU'(conv), dxc[t] = sum_{k<K, t+k<L} wConv[d,k] dconv[t+k],
//   dwConv[d,k] = sum_t dconv[t] xc[t-k] (t-k >= 0), dbConv[d] = sum_t dconv[t].
//
// Design: a workgroup of 256 invocations takes 64 channels (32 pairs, lx = li % 32, each
// invocation two adjacent channels d, d + 1) and 8 lanes (ly = li / 32) of consecutive
// rows. Every per-invocation loop runs over the constants K, RPI or T, so they unroll and
// the small arrays (taps, xc rows, dconv rows, weight-gradient sums) stay in registers. The
// workgroup index (flattened, flat_index's grid) = channel group + G x tile (forward) or
// row block (backward).
// - Forward: an invocation takes RPI rows r0.. (a tile of 8 RPI rows a workgroup) and reads
//   their xc, with the K - 1 rows before them, straight from storage into registers, every
//   load before the first use, so that they are in flight together (the halo rows are its
//   neighbours': read again from the cache). No workgroup memory, no barrier.
// - Backward: a row block in tiles of T rows (RPT = T / 8 an invocation). Each xc row there
//   serves 2K - 1 rows (conv again for dconv, then dwConv), so the tile's xc rows, with the
//   K - 1 before and after it, are staged once in workgroup memory (coalesced loads, each
//   word read once) and every tap reads them from there. dconv is never stored: an
//   invocation computes it for its RPT rows and the K - 1 after them (recomputed by the next
//   lane). A tile's loads (its du rows, its words of the staged rows) are issued while the
//   tile before it runs, into registers, and staged in the other of two buffers (one
//   barrier a tile: the kernel is bound by its loads' latency, not their bytes). T (a
//   multiple of 8, RPT <= RPTMAX) is chosen by the host to fit the device's workgroup
//   memory (2 (T + 2 (K - 1)) x 256 bytes + 2 KB).
//
// Y holds f32 values or, with HALF, f16 pairs (two per word, element e in half e % 2: the
// f16 mode's cache, read where it is used instead of unpacked into an f32 copy). With
// OUT16 the forward also writes u's f16 copy (the f16 mode's operand of x_proj; with OUT16T
// its transpose, x_proj's weight-gradient operand, from the restore), and the
// backward writes dY's xc half as f16 pairs (in_proj's operand in the f16 mode; D even)
// and sums dxc per channel (in_proj's bias gradient, from the f32 values).
//
// Bindings, conv1d_forward (one tile of 8 RPI rows per workgroup):
// | binding | name | shape   | access                                                 |
// |---------|------|---------|--------------------------------------------------------|
// | 0       | p    | Params  | uniform                                                |
// | 1       | Y    | (M, 2D) | read: in_proj output; xc = Y[:, 0:D] (row stride y_rs; f32 or f16) |
// | 2       | w    | (..)    | read: parameter arena, wConv (D, K) at w_off, bConv (D) at b_off |
// | 3       | u    | (M, D)  | read_write: SiLU(conv), the scan input                  |
// | 7       | u16  | (M, D)  | read_write (OUT16): u in f16 pairs                      |
// | 8       | u16t | (D, M)  | read_write (OUT16T): u transposed in f16 pairs (RPI 8, M % 8 = 0; through workgroup memory) |
// conv1d_backward (row block rb = rows [rb rows_per, (rb + 1) rows_per) in tiles of T rows;
// dwConv, dbConv summed per invocation, then over its 8 lanes in a fixed order into part)
// and conv1d_backward_weight_final (one invocation per (k, d): adds the RB partials in the
// order rb = 0..RB-1): no atomics, fixed summation order.
// | 1       | Y    | (M, 2D) | read: xc columns                                        |
// | 2       | w    | (..)    | read: parameter arena                                  |
// | 3       | du   | (M, D)  | read: dLoss/du (scan path + x_proj path)                |
// | 4       | dY   | (M, 2D) | backward: write dY[:, 0:D] = dxc (f32, or with OUT16 f16 pairs) |
// | 5       | part | (RB, KS, D) | backward: write; final: read (k = K: the bias; K + 1: dxc) |
// | 6       | g    | (..)    | final: read_write: gradient arena, wConv at w_off, bConv at b_off, |
// |         |      |         | (OUT16) in_proj's bias at bin_off (+=)                  |

struct Params { M: u32, L: u32, D: u32, K: u32, y_rs: u32, w_off: u32, b_off: u32,
                rows_per: u32, RB: u32, bin_off: u32 }

override K: u32 = 4u;         // dConv (= p.K)
override RPI: u32 = 8u;       // conv1d_forward: rows per invocation
override T: u32 = 32u;        // conv1d_backward: rows per tile, a multiple of 8
override HALF: bool = false;  // Y as f16 pairs
override OUT16: bool = false; // forward: also u's f16 copy; backward: dY in f16 (see below)
override OUT16T: bool = false; // conv1d_forward: also u's f16 transpose (x_proj's dW operand)
const KMAX: u32 = 24u;        // taps in registers
const RPIMAX: u32 = 8u;       // RPI at most
const RPTMAX: u32 = 4u;       // conv1d_backward's rows per invocation in a tile (T / 8) at most

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> Y: array<u32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;

// (KMAX,) wConv of channels d and d + 1, paired; their bConv.
var<private> wk: array<vec2<f32>, KMAX>;
var<private> bk: vec2<f32>;
// (RPIMAX + KMAX - 1,) conv1d_forward: xc pairs of rows r0 - (K - 1) .. r0 + RPI - 1, r0
// the invocation's first row
var<private> xw: array<vec2<f32>, RPIMAX + KMAX - 1u>;

// The taps and biases of the channel pair d, d + 1 (the second 0 past D).
fn load_taps(d: u32) {
    for (var k = 0u; k < K; k++) { wk[k] = vec2<f32>(w[p.w_off + d * K + k], 0.0); }
    bk = vec2<f32>(w[p.b_off + d], 0.0);
    if (d + 1u < p.D) {
        for (var k = 0u; k < K; k++) { wk[k].y = w[p.w_off + (d + 1u) * K + k]; }
        bk.y = w[p.b_off + d + 1u];
    }
}

// xc of row r (0 outside [0, M)) at channels d, d + 1 (0 past D).
fn xc_pair(r: i32, d: u32) -> vec2<f32> { return xc_value(xc_words(r, d), d); }

// The words xc_pair reads (one f16 pair with HALF, else two f32; 0 outside), and their
// values: apart, so that conv1d_backward issues a tile's loads a tile before it uses them.
fn xc_words(r: i32, d: u32) -> vec2<u32> {
    if (r < 0 || u32(r) >= p.M || d >= p.D) { return vec2<u32>(0u); }
    let e = u32(r) * p.y_rs + d;          // even: y_rs and d are
    if (HALF) { return vec2<u32>(Y[e / 2u], 0u); }
    var v = vec2<u32>(Y[e], 0u);
    if (d + 1u < p.D) { v.y = Y[e + 1u]; }
    return v;
}

fn xc_value(h: vec2<u32>, d: u32) -> vec2<f32> {
    var v = vec2<f32>(0.0);
    if (HALF) {
        v.x = f16_value(h.x & 0xffffu);
        if (d + 1u < p.D) { v.y = f16_value(h.x >> 16u); }
    } else {
        v = bitcast<vec2<f32>>(h);
    }
    return v;
}

// This workgroup's channel group (x: channels 64 x .. 64 x + 63) and its place along the
// rows (y: the forward's tile, the backward's row block), from the flattened grid
// (flat_index's split).
fn wg_place(wid: vec3<u32>, nwg: vec3<u32>) -> vec2<u32> {
    let G = (p.D + 63u) / 64u;
    let wf = wid.y * nwg.x + wid.x;
    return vec2<u32>(wf % G, wf / G);
}

@group(0) @binding(3) var<storage, read_write> f_u: array<f32>;
@group(0) @binding(7) var<storage, read_write> f_u16: array<u32>;
// (D, M / 8): 8 rows of a channel in f16 pairs a word (16 bytes)
@group(0) @binding(8) var<storage, read_write> f_u16t: array<vec4<u32>>;
// (RPIMAX,) f16 bits of u at the channel pair, row r0 + j (OUT16T)
var<private> ub: array<vec2<u32>, RPIMAX>;
// (64, 8) OUT16T: the workgroup's u^T in f16, channel-major: [channel][invocation row
// group], so that its stores run along M (a subgroup writes whole 128-byte rows of 4
// channels instead of 16 bytes at 32 channels' places)
var<workgroup> ut_s: array<vec4<u32>, 512>;

@compute @workgroup_size(256)
fn conv1d_forward(@builtin(local_invocation_index) li: u32,
                  @builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>) {
    let pl = wg_place(wid, nwg);
    let d = pl.x * 64u + 2u * (li % 32u);
    let r0 = (pl.y * 8u + li / 32u) * RPI;
    if (d < p.D && r0 < p.M) {
        load_taps(d);
        for (var i = 0u; i < RPI + K - 1u; i++) { xw[i] = xc_pair(i32(r0 + i) - i32(K - 1u), d); }
        for (var j = 0u; j < RPI; j++) {
            let r = r0 + j;
            if (r >= p.M) { break; }
            let t = r % p.L;
            var s = bk;                      // bConv + taps from k = 0 up, as the CPU sums
            for (var k = 0u; k < K; k++) {
                if (k <= t) { s += wk[k] * xw[j + K - 1u - k]; }
            }
            let v = vec2<f32>(silu(s.x), silu(s.y));
            f_u[r * p.D + d] = v.x;
            if (d + 1u < p.D) { f_u[r * p.D + d + 1u] = v.y; }
            if (OUT16) { f_u16[(r * p.D + d) / 2u] = f16_pair(v.x, v.y); }
            if (OUT16T) { ub[j] = vec2<u32>(f16_bits(v.x), f16_bits(v.y)); }
        }
    }
    if (OUT16T) {                            // RPI 8: one word of 8 rows per channel
        let c = 2u * (li % 32u);
        let q = li / 32u;
        ut_s[c * 8u + q] = vec4<u32>(ub[0].x | (ub[1].x << 16u), ub[2].x | (ub[3].x << 16u),
                                     ub[4].x | (ub[5].x << 16u), ub[6].x | (ub[7].x << 16u));
        ut_s[(c + 1u) * 8u + q] = vec4<u32>(ub[0].y | (ub[1].y << 16u), ub[2].y | (ub[3].y << 16u),
                                            ub[4].y | (ub[5].y << 16u), ub[6].y | (ub[7].y << 16u));
        workgroupBarrier();
        for (var e = li; e < 512u; e += 256u) {
            let dc = pl.x * 64u + e / 8u;    // channel
            let g = pl.y * 8u + e % 8u;      // its 8-row word: rows 8 g .. 8 g + 7, all below M
            if (dc < p.D && 8u * g < p.M) { f_u16t[dc * (p.M / 8u) + g] = ut_s[e]; }
        }
    }
}

@group(0) @binding(3) var<storage, read> b_du: array<f32>;
@group(0) @binding(4) var<storage, read_write> b_dY: array<u32>;
@group(0) @binding(5) var<storage, read_write> b_part: array<f32>;
@group(0) @binding(6) var<storage, read_write> b_g: array<f32>;

// (2, T + 2 (K - 1), 32) xc pairs of rows r0 - (K - 1) .. r0 + T + K - 2, two tiles' (the
// one being run, the next one staged)
var<workgroup> xs_b: array<vec2<f32>, 2u * (T + 2u * K - 2u) * 32u>;
fn xs_len() -> u32 { return (T + 2u * K - 2u) * 32u; }        // one tile's
// (8, 32) one tap's sums (channel pairs) of the workgroup's eight lanes, summed in the
// order ly = 0..7
var<workgroup> red: array<vec2<f32>, 256>;
// (RPTMAX + KMAX - 1,) du, then dconv, of this invocation's rows and the K - 1 after them
// (0 past M)
var<private> dc: array<vec2<f32>, RPTMAX + KMAX - 1u>;
// the next tile's du rows (as dc) and this invocation's words of its staged xc rows (element
// li + 256 j of xs_b's tile), loaded while the current tile runs
var<private> ndu: array<vec2<f32>, RPTMAX + KMAX - 1u>;
const XW: u32 = ((8u * RPTMAX + 2u * KMAX - 2u) * 32u + 255u) / 256u;
var<private> nxs: array<vec2<u32>, XW>;
// (KMAX + 2,) this invocation's sums of dwConv (k < K), dbConv (k = K) and, with OUT16,
// of dxc (k = K + 1: in_proj's bias gradient)
var<private> acc: array<vec2<f32>, KMAX + 2u>;
// the sums per channel a row block has: K taps, the bias, (OUT16) dxc
fn n_sums() -> u32 { return K + select(1u, 2u, OUT16); }

// The step in its sequence of the row i after one at step tq, (tq + i) % L: the division
// only where the rows pass a sequence's end (one % per tile instead of one per row).
fn step_at(tq: u32, i: u32) -> u32 {
    var t = tq + i;
    if (t >= p.L) { t = t % p.L; }
    return t;
}

// Load the tile of rows r0..: du of this invocation's rows (and the K - 1 after them) into
// ndu, its words of the tile's xc rows into nxs.
fn load_tile(on: bool, two: bool, li: u32, q0: u32, d: u32, c0: u32, r0: u32) {
    if (on) {
        for (var i = 0u; i < T / 8u + K - 1u; i++) {
            let r = r0 + q0 + i;
            var v = vec2<f32>(0.0);
            if (r < p.M) {
                v.x = b_du[r * p.D + d];
                if (two) { v.y = b_du[r * p.D + d + 1u]; }
            }
            ndu[i] = v;
        }
    }
    for (var j = 0u; j < XW; j++) {
        let i = li + 256u * j;
        if (i < xs_len()) { nxs[j] = xc_words(i32(r0 + i / 32u) - i32(K - 1u), c0 + 2u * (i % 32u)); }
    }
}

@compute @workgroup_size(256)
fn conv1d_backward(@builtin(local_invocation_index) li: u32,
                   @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>) {
    let pl = wg_place(wid, nwg);
    let rb = pl.y;                              // uniform per workgroup: barriers below
    let lx = li % 32u;
    let d = pl.x * 64u + 2u * lx;
    let on = d < p.D && rb < p.RB;
    let two = d + 1u < p.D;
    let RPT = T / 8u;
    let q0 = (li / 32u) * RPT;
    let r1 = min(p.M, (rb + 1u) * p.rows_per);
    let KS = n_sums();
    for (var k = 0u; k < KS; k++) { acc[k] = vec2<f32>(0.0); }
    if (on) { load_taps(d); }
    // each tile's loads are issued a tile ahead (ndu, nxs), its xc rows staged into the
    // buffer of xs_b the tile before last read: one barrier a tile
    if (rb * p.rows_per < r1) { load_tile(on, two, li, q0, d, pl.x * 64u, rb * p.rows_per); }
    for (var r0 = rb * p.rows_per; r0 < r1; r0 += T) {
        let xb = ((r0 - rb * p.rows_per) / T) % 2u * xs_len();
        for (var i = 0u; i < RPT + K - 1u; i++) { dc[i] = ndu[i]; }
        for (var j = 0u; j < XW; j++) {
            let i = li + 256u * j;
            if (i < xs_len()) { xs_b[xb + i] = xc_value(nxs[j], pl.x * 64u + 2u * (i % 32u)); }
        }
        workgroupBarrier();
        if (r0 + T < r1) { load_tile(on, two, li, q0, d, pl.x * 64u, r0 + T); }
        if (on) {
            let tq = (r0 + q0) % p.L;                       // step of row r0 + q0 in its sequence
            for (var i = 0u; i < RPT + K - 1u; i++) {      // dconv of rows r0 + q0 + i
                let r = r0 + q0 + i;
                var v = vec2<f32>(0.0);
                if (r < p.M) {
                    let t = step_at(tq, i);
                    var s = bk;
                    for (var k = 0u; k < K; k++) {
                        if (k <= t) { s += wk[k] * xs_b[xb + (q0 + i + K - 1u - k) * 32u + lx]; }
                    }
                    v.x = dc[i].x * dsilu(s.x);
                    if (two) { v.y = dc[i].y * dsilu(s.y); }
                }
                dc[i] = v;
            }
            for (var j = 0u; j < RPT; j++) {
                let r = r0 + q0 + j;
                if (r >= r1) { break; }
                let t = step_at(tq, j);
                var s = vec2<f32>(0.0);
                for (var k = 0u; k < K; k++) {
                    if (t + k < p.L) { s += wk[k] * dc[j + k]; }
                    if (k <= t) { acc[k] += dc[j] * xs_b[xb + (q0 + j + K - 1u - k) * 32u + lx]; }
                }
                acc[K] += dc[j];
                if (OUT16) {                        // f16 pairs (D even); their f32 sums
                    b_dY[(r * p.y_rs + d) / 2u] = f16_pair(s.x, s.y);
                    acc[K + 1u] += s;
                } else {
                    b_dY[r * p.y_rs + d] = bitcast<u32>(s.x);
                    if (two) { b_dY[r * p.y_rs + d + 1u] = bitcast<u32>(s.y); }
                }
            }
        }
    }
    for (var k = 0u; k < KS; k++) {
        red[li] = acc[k];
        workgroupBarrier();
        if (li < 32u && on) {
            var s = red[li];
            for (var l = 1u; l < 8u; l++) { s += red[l * 32u + li]; }
            b_part[(rb * KS + k) * p.D + d] = s.x;
            if (two) { b_part[(rb * KS + k) * p.D + d + 1u] = s.y; }
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn conv1d_backward_weight_final(@builtin(local_invocation_index) li: u32,
                                @builtin(workgroup_id) wid: vec3<u32>,
                                @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = flat_index(wid, nwg, li, 256u);
    let KS = n_sums();
    if (e >= KS * p.D) { return; }
    let k = e / p.D;
    let d = e % p.D;
    var s = 0.0;
    for (var rb = 0u; rb < p.RB; rb++) { s += b_part[(rb * KS + k) * p.D + d]; }
    var o = p.w_off + d * K + k;
    if (k == K) { o = p.b_off + d; }
    if (k == K + 1u) { o = p.bin_off + d; }
    b_g[o] = b_g[o] + s;
}
