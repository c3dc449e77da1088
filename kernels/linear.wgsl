// linear.wgsl — register-tiled matrix product of every linear layer (in_proj,
// x_proj, dt_proj, out_proj, the tied LM head), forward and backward, with the
// bias, the residual and the bias gradient fused in. The GPU side of
// mamba_ext/cpu/linear.pyx. common.wgsl is prepended by the loader.
//
// Size letters: B batch, L seqLen, Dm dModel, D dInner, R dtRank, P = R + 2N,
// M = B*L rows, V vocab. In this file the product itself is (rows x cols) with
// contraction length Params.K: Params.M rows, Params.N columns (not dState),
// Params.K (not dConv); S = split-K slices (grid z).
//
//   C[i, j] = beta * C[i, j] + sum_k A(i, k) * B(k, j) (+ bias[j]) (+ res[i, j])
//   A(i, k) = a[a_off + i*a_rs + k*a_cs], B(k, j) = b[b_off + k*b_rs + j*b_cs],
//   C[i, j] = c[c_off + i*c_rs + j],  res[i, j] = res[i*c_rs + j]
//   BIAS_GRAD: also dbias[db_off + i] += sum_k A(i, k)  (dW = dY^T X: the row sums of
//              A = dY^T are the bias gradient, summed from the tiles already on chip)
//
// Strides let one kernel serve the three products of a linear layer
// Y = X W^T + b with X (M, I), W (O, I), Y (M, O), with no transposed copies:
//   linear_forward   Y  = X  @ W^T (+ b) (+ residual): A = X (rs I, cs 1), B = W^T (rs 1, cs I)
//   linear_backward  dX += dY @ W   : A = dY (rs O, cs 1), B = W (rs I, cs 1)
//   linear_backward  dW += dY^T @ X : A = dY^T (rs 1, cs O), B = X (rs I, cs 1), + db
// and column slices (x_proj's dt_low | Bs | Cs columns, in_proj's xc | z halves) by
// offsets and row strides. Every output element is summed by one invocation in a
// fixed k order (no float atomics): deterministic. With split-K (S > 1: products
// of few tiles, e.g. the dW products, whose contraction is M = B*L long and whose
// output is small, or any product at batch 1) slice z writes its partial products
// to part (S, M, N) and its row sums to part[S*M*N + z*M + i]; linear_split_sum
// adds the S slices in the order z = 0..S-1 and applies the epilogue (bias,
// residual, beta, bias gradient).
//
// Bindings (all entry points; shapes in elements, strides as above):
// | binding | name  | shape                        | access                                  |
// |---------|-------|------------------------------|-----------------------------------------|
// | 0       | p     | Params                       | uniform                                 |
// | 1       | a     | A operand (M, K)             | read                                    |
// | 2       | a4    | the same buffer as a, vec4   | read (16-byte loads when A_VEC)         |
// | 3       | b     | B operand (K, N)             | read                                    |
// | 4       | b4    | the same buffer as b, vec4   | read (16-byte loads when B_VEC)         |
// | 5       | bias  | (N,) at bias_off             | read (when has_bias = 1)                |
// | 6       | res   | (M, N), row stride c_rs      | read (when has_res = 1: out_proj's x)   |
// | 7       | c     | C output (M, N)              | read_write                              |
// | 8       | part  | (S*M*N + S*M)                | read_write (split-K partials, S > 1)    |
// | 9       | dbias | (M,) at db_off               | read_write (when BIAS_GRAD)             |
//
// DBIAS_IN_C: the bias gradient lives in c's buffer (a model's gradient arena holds dW
// and db side by side), written through binding 7 at db_off, and binding 9 holds a
// placeholder: WebGPU forbids one buffer behind two writable bindings of a dispatch.
//
// Tile: BM x BN = 128 x 128 outputs per workgroup of 16 x 16 invocations; each
// invocation holds an 8 x 8 micro-tile (rows 4ty..4ty+3 and 64+4ty.., columns
// 4tx.. and 64+4tx..) in 16 named vec4 registers (no private arrays: dynamically
// indexed ones spill to local memory). k advances in steps of BK = 16 through
// workgroup memory (16 KiB). The 16 k of a step are written out as 16 calls of
// `mac` with a constant k, not a loop: the shader compiler then folds every
// workgroup-memory address to a constant plus one of four values computed once,
// where a loop pays index arithmetic and a bounds clamp per load for each k
// (measured on an H200: 23.5 -> 28.7 TFLOP/s on in_proj's dX, docs/gpu_h200.txt).
// PREFETCH: the next step's operands are loaded into registers while this step
// is computed, then stored after a barrier. Both operands are kept k-major in
// workgroup memory (As[k][i], Bs[k][j]: slot s of a k row = rows 4s..4s+3), placed
// so that every address of the compute loop is ty or tx plus a constant (an XOR
// swizzle costs index arithmetic per read: block d's products 33.6 -> 34.6 TFLOP/s
// without it; see tix). A k-contiguous operand (the
// forward's X and W^T, the backward's dY) is loaded as 4 rows x 4 k per invocation
// and transposed in registers, so that every workgroup store is 16 bytes (scalar
// transposing stores cost a third of the forward's speed). Stores and the compute
// loop's reads (broadcast for A, 16 consecutive vec4 for B) are conflict-free (see
// share_pos and tix). Out-of-range rows, columns and k are zero-filled on load and
// skipped on store, so no size needs to be a multiple of a tile.

struct Params {
    M: u32, N: u32, K: u32,
    a_off: u32, a_rs: u32, a_cs: u32,
    b_off: u32, b_rs: u32, b_cs: u32,
    c_off: u32, c_rs: u32,
    bias_off: u32, has_bias: u32, beta: u32, has_res: u32,
    db_off: u32, kc: u32,
}

// A_KFAST: A is contiguous along k (a_cs = 1), else along i (a_rs = 1, or any
// strides with A_VEC off). B_KFAST: B contiguous along k (b_rs = 1), else along j.
// A_VEC / B_VEC: 16-byte aligned runs, loaded as vec4.
override A_KFAST: bool = true;
override B_KFAST: bool = true;
override A_VEC: bool = false;
override B_VEC: bool = false;
override BIAS_GRAD: bool = false;
override DBIAS_IN_C: bool = false;     // see the binding table
override SPLIT: bool = false;
// PREFETCH: the next step's loads in flight during this one (see gemm_tile); off = the
// plain loop (load, store, barrier, compute, barrier).
override PREFETCH: bool = true;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> a4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read> b4: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> bias: array<f32>;
@group(0) @binding(6) var<storage, read> res: array<f32>;
@group(0) @binding(7) var<storage, read_write> c: array<f32>;
@group(0) @binding(8) var<storage, read_write> part: array<f32>;
@group(0) @binding(9) var<storage, read_write> dbias: array<f32>;

const BK: u32 = 16u;
const SLOTS: u32 = 32u;                 // vec4 slots per k row of a 128-wide tile
// ROT (set by the host where the device has >= 20 KiB of workgroup memory): k rows of
// TROW = 40 vec4, a k-contiguous operand's slot s of row k at s + 2 (k / 4), see tix;
// else rows of 32, unshifted.
override ROT: bool = false;
override TROW: u32 = select(SLOTS, 40u, ROT);

// (2 BK, TROW) vec4: rows k = 0..BK-1 the A tile As[k][i], rows BK + k the B tile
// Bs[k][j], k-major; 16 KiB, 20 KiB with ROT.
var<workgroup> T: array<vec4<f32>, 2u * BK * TROW>;

// Index in T of slot s of row base + k (base 0: A's tile, BK: B's; k < BK) of an
// operand that is k-contiguous or not (kfast). With ROT a k-contiguous operand's
// slots are shifted by 2 (k / 4): the four k = 4h + c that a quarter-warp stores at
// once (share_pos) then fall in distinct banks, and the shift is a constant at every
// read of `mac`, as no shift is.
fn tix(base: u32, k: u32, s: u32, kfast: bool) -> u32 {
    return (base + k) * TROW + s + select(0u, 2u * (k >> 2u), ROT && kfast);
}

// The micro-tile of this invocation (see gemm_tile): module-scope so that `mac` can
// update it; the compiler keeps them in registers once `mac` is inlined.
var<private> c00: vec4<f32>; var<private> c01: vec4<f32>;
var<private> c10: vec4<f32>; var<private> c11: vec4<f32>;
var<private> c20: vec4<f32>; var<private> c21: vec4<f32>;
var<private> c30: vec4<f32>; var<private> c31: vec4<f32>;
var<private> c40: vec4<f32>; var<private> c41: vec4<f32>;
var<private> c50: vec4<f32>; var<private> c51: vec4<f32>;
var<private> c60: vec4<f32>; var<private> c61: vec4<f32>;
var<private> c70: vec4<f32>; var<private> c71: vec4<f32>;
var<private> rs0: vec4<f32>; var<private> rs1: vec4<f32>;

// A(i, k..k+3) (A_KFAST) or A(i..i+3, k) (else), zero outside [0, M) x [0, klim).
fn load_a(i: u32, k: u32, klim: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if (A_KFAST) {
        if (i >= p.M) { return v; }
        let base = p.a_off + i * p.a_rs + k;
        if (A_VEC && k + 3u < klim) { return a4[base >> 2u]; }
        for (var q = 0u; q < 4u; q++) { if (k + q < klim) { v[q] = a[base + q]; } }
    } else {
        if (k >= klim) { return v; }
        let base = p.a_off + i * p.a_rs + k * p.a_cs;
        if (A_VEC && i + 3u < p.M) { return a4[base >> 2u]; }
        for (var q = 0u; q < 4u; q++) { if (i + q < p.M) { v[q] = a[base + q * p.a_rs]; } }
    }
    return v;
}

// B(k..k+3, j) (B_KFAST) or B(k, j..j+3) (else), zero outside [0, klim) x [0, N).
fn load_b(j: u32, k: u32, klim: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if (B_KFAST) {
        if (j >= p.N) { return v; }
        let base = p.b_off + k + j * p.b_cs;
        if (B_VEC && k + 3u < klim) { return b4[base >> 2u]; }
        for (var q = 0u; q < 4u; q++) { if (k + q < klim) { v[q] = b[base + q]; } }
    } else {
        if (k >= klim) { return v; }
        let base = p.b_off + k * p.b_rs + j;
        if (B_VEC && j + 3u < p.N) { return b4[base >> 2u]; }
        for (var q = 0u; q < 4u; q++) { if (j + q < p.N) { v[q] = b[base + q * p.b_cs]; } }
    }
    return v;
}

// One step's tiles are loaded by the workgroup split in two (warp-uniform): invocations
// 0..127 load A's tile, 128..255 B's, four vec4 each (share q = 0..3). Position of
// share q in its tile (row or column, k):
// - k-contiguous operand (KFAST): rows (columns) 4g+q at k 4h..4h+3; a warp reads
//   8 rows x 64 contiguous bytes (4 h). ROT: g = t / 4, h = t % 4 (a quarter-warp
//   reads 2 rows x 64 bytes and stores 2 g x 4 h, in distinct banks by tix's shift);
//   else t's bits are 2 g-high | 2 h | 3 g-low (a quarter-warp stores one h, 8
//   consecutive g: 8 consecutive slots; its loads touch 8 rows, slower);
// - otherwise: vec4 number v = t + 128 q of the tile: k = v / 32, rows 4 (v % 32)..+3.
fn share_pos(t: u32, q: u32, kfast: bool) -> vec2<u32> {
    if (kfast && ROT) { return vec2<u32>(4u * (t >> 2u) + q, (t & 3u) << 2u); }
    if (kfast) { return vec2<u32>(4u * (((t >> 5u) << 3u) | (t & 7u)) + q, ((t >> 3u) & 3u) << 2u); }
    let v = t + 128u * q;
    return vec2<u32>((v & 31u) << 2u, v >> 5u);
}

fn fetch(tid: u32, row0: u32, col0: u32, k0: u32, klim: u32, q: u32) -> vec4<f32> {
    if (tid < 128u) {
        let pos = share_pos(tid, q, A_KFAST);
        return load_a(row0 + pos.x, k0 + pos.y, klim);
    }
    let pos = share_pos(tid - 128u, q, B_KFAST);
    return load_b(col0 + pos.x, k0 + pos.y, klim);
}

// Store the four shares of fetch into T (A at rows 0..15, B at 16..31). A KFAST share
// (4 rows x 4 k) is transposed in registers into one vec4 per k, so every store is
// 16 bytes (share_pos, tix: a quarter-warp's eight stores hit distinct banks).
fn put(tid: u32, r0: vec4<f32>, r1: vec4<f32>, r2: vec4<f32>, r3: vec4<f32>) {
    let t = tid & 127u;
    let base = select(BK, 0u, tid < 128u);
    if (select(B_KFAST, A_KFAST, tid < 128u)) {
        let pos = share_pos(t, 0u, true);
        let g = pos.x >> 2u;
        let k = pos.y;
        T[tix(base, k, g, true)] = vec4<f32>(r0.x, r1.x, r2.x, r3.x);
        T[tix(base, k + 1u, g, true)] = vec4<f32>(r0.y, r1.y, r2.y, r3.y);
        T[tix(base, k + 2u, g, true)] = vec4<f32>(r0.z, r1.z, r2.z, r3.z);
        T[tix(base, k + 3u, g, true)] = vec4<f32>(r0.w, r1.w, r2.w, r3.w);
    } else {
        let v = vec4<u32>(t, t + 128u, t + 256u, t + 384u);
        let k = v >> vec4<u32>(5u);
        let sl = v & vec4<u32>(31u);
        T[tix(base, k.x, sl.x, false)] = r0;
        T[tix(base, k.y, sl.y, false)] = r1;
        T[tix(base, k.z, sl.z, false)] = r2;
        T[tix(base, k.w, sl.w, false)] = r3;
    }
}

// Step k of the micro-tile: rows from As[k], columns from Bs[k] (k is a constant at
// every call, see the header).
fn mac(k: u32, ty: u32, tx: u32, rows_sum: bool) {
    let a0 = T[tix(0u, k, ty, A_KFAST)];
    let a1 = T[tix(0u, k, ty + 16u, A_KFAST)];
    let b0 = T[tix(BK, k, tx, B_KFAST)];
    let b1 = T[tix(BK, k, tx + 16u, B_KFAST)];
    c00 = fma(vec4<f32>(a0.x), b0, c00); c01 = fma(vec4<f32>(a0.x), b1, c01);
    c10 = fma(vec4<f32>(a0.y), b0, c10); c11 = fma(vec4<f32>(a0.y), b1, c11);
    c20 = fma(vec4<f32>(a0.z), b0, c20); c21 = fma(vec4<f32>(a0.z), b1, c21);
    c30 = fma(vec4<f32>(a0.w), b0, c30); c31 = fma(vec4<f32>(a0.w), b1, c31);
    c40 = fma(vec4<f32>(a1.x), b0, c40); c41 = fma(vec4<f32>(a1.x), b1, c41);
    c50 = fma(vec4<f32>(a1.y), b0, c50); c51 = fma(vec4<f32>(a1.y), b1, c51);
    c60 = fma(vec4<f32>(a1.z), b0, c60); c61 = fma(vec4<f32>(a1.z), b1, c61);
    c70 = fma(vec4<f32>(a1.w), b0, c70); c71 = fma(vec4<f32>(a1.w), b1, c71);
    if (rows_sum) { rs0 += a0; rs1 += a1; }
}

// Results of row i, columns j..j+3 (fused epilogue).
fn store_c(i: u32, j: u32, v: vec4<f32>, z: u32) {
    if (i >= p.M) { return; }
    for (var q = 0u; q < 4u; q++) {
        let jj = j + q;
        if (jj < p.N) {
            if (SPLIT) {
                part[(z * p.M + i) * p.N + jj] = v[q];
            } else {
                let o = p.c_off + i * p.c_rs + jj;
                var r = v[q];
                if (p.has_bias == 1u) { r += bias[p.bias_off + jj]; }
                if (p.has_res == 1u) { r += res[i * p.c_rs + jj]; }
                if (p.beta == 1u) { r += c[o]; }
                c[o] = r;
            }
        }
    }
}

// Bias-gradient row sums of A for rows i..i+3 (S = number of split-K slices).
fn store_rowsum(i: u32, v: vec4<f32>, z: u32, S: u32) {
    for (var q = 0u; q < 4u; q++) {
        let ii = i + q;
        if (ii < p.M) {
            if (SPLIT) {
                part[S * p.M * p.N + z * p.M + ii] = v[q];
            } else if (DBIAS_IN_C) {
                c[p.db_off + ii] = c[p.db_off + ii] + v[q];
            } else {
                dbias[p.db_off + ii] = dbias[p.db_off + ii] + v[q];
            }
        }
    }
}

fn gemm_tile(lid: vec3<u32>, wid: vec3<u32>, nwg: vec3<u32>) {
    if (p.M == 0xffffffffu) {
        // Never true (sizes are checked on the host): keeps every binding statically
        // used, so the "auto" pipeline layout has all of them whatever the overrides.
        c[0] = a[0] + a4[0].x + b[0] + b4[0].x + bias[0] + res[0];
        part[0] = 0.0; dbias[0] = 0.0;
    }
    let tx = lid.x;
    let ty = lid.y;
    let tid = ty * 16u + tx;
    let row0 = wid.y * 128u;
    let col0 = wid.x * 128u;
    let z = wid.z;
    let kbeg = z * p.kc;
    let kend = min(p.K, kbeg + p.kc);
    let rows_sum = BIAS_GRAD && wid.x == 0u;     // uniform per workgroup
    // The 8 x 8 micro-tile of this invocation: rows 4ty+r (c0r..c3r) and 64+4ty+r
    // (c4r..c7r), columns 4tx.. (cr0) and 64+4tx.. (cr1); rs0/rs1: row sums of A
    // (BIAS_GRAD). Private variables start at zero.
    // PREFETCH: the next step's operands are loaded into registers while this step is
    // computed, then stored after a barrier (everyone done reading the tile).
    var r0 = vec4<f32>(0.0); var r1 = vec4<f32>(0.0);
    var r2 = vec4<f32>(0.0); var r3 = vec4<f32>(0.0);
    if (PREFETCH) {
        r0 = fetch(tid, row0, col0, kbeg, kend, 0u); r1 = fetch(tid, row0, col0, kbeg, kend, 1u);
        r2 = fetch(tid, row0, col0, kbeg, kend, 2u); r3 = fetch(tid, row0, col0, kbeg, kend, 3u);
        put(tid, r0, r1, r2, r3);
        workgroupBarrier();
    }
    for (var k0 = kbeg; k0 < kend; k0 += BK) {
        let more = k0 + BK < kend;                // uniform
        if (!PREFETCH) {
            put(tid, fetch(tid, row0, col0, k0, kend, 0u), fetch(tid, row0, col0, k0, kend, 1u),
                fetch(tid, row0, col0, k0, kend, 2u), fetch(tid, row0, col0, k0, kend, 3u));
            workgroupBarrier();
        } else if (more) {
            let kn = k0 + BK;
            r0 = fetch(tid, row0, col0, kn, kend, 0u); r1 = fetch(tid, row0, col0, kn, kend, 1u);
            r2 = fetch(tid, row0, col0, kn, kend, 2u); r3 = fetch(tid, row0, col0, kn, kend, 3u);
        }
        mac(0u, ty, tx, rows_sum); mac(1u, ty, tx, rows_sum);
        mac(2u, ty, tx, rows_sum); mac(3u, ty, tx, rows_sum);
        mac(4u, ty, tx, rows_sum); mac(5u, ty, tx, rows_sum);
        mac(6u, ty, tx, rows_sum); mac(7u, ty, tx, rows_sum);
        mac(8u, ty, tx, rows_sum); mac(9u, ty, tx, rows_sum);
        mac(10u, ty, tx, rows_sum); mac(11u, ty, tx, rows_sum);
        mac(12u, ty, tx, rows_sum); mac(13u, ty, tx, rows_sum);
        mac(14u, ty, tx, rows_sum); mac(15u, ty, tx, rows_sum);
        workgroupBarrier();                       // everyone done reading the tile
        if (PREFETCH && more) {
            put(tid, r0, r1, r2, r3);
            workgroupBarrier();
        }
    }
    let i0 = row0 + 4u * ty;
    let i1 = row0 + 64u + 4u * ty;
    let j0 = col0 + 4u * tx;
    let j1 = col0 + 64u + 4u * tx;
    store_c(i0, j0, c00, z); store_c(i0, j1, c01, z);
    store_c(i0 + 1u, j0, c10, z); store_c(i0 + 1u, j1, c11, z);
    store_c(i0 + 2u, j0, c20, z); store_c(i0 + 2u, j1, c21, z);
    store_c(i0 + 3u, j0, c30, z); store_c(i0 + 3u, j1, c31, z);
    store_c(i1, j0, c40, z); store_c(i1, j1, c41, z);
    store_c(i1 + 1u, j0, c50, z); store_c(i1 + 1u, j1, c51, z);
    store_c(i1 + 2u, j0, c60, z); store_c(i1 + 2u, j1, c61, z);
    store_c(i1 + 3u, j0, c70, z); store_c(i1 + 3u, j1, c71, z);
    if (rows_sum && tx == 0u) {
        store_rowsum(i0, rs0, z, nwg.z);
        store_rowsum(i1, rs1, z, nwg.z);
    }
}

@compute @workgroup_size(16, 16)
fn linear_forward(@builtin(local_invocation_id) lid: vec3<u32>,
                  @builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>) {
    gemm_tile(lid, wid, nwg);
}

@compute @workgroup_size(16, 16)
fn linear_backward(@builtin(local_invocation_id) lid: vec3<u32>,
                   @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>) {
    gemm_tile(lid, wid, nwg);
}

// linear_split_sum: C[i, j] = sum_z part[z, i, j] + epilogue (as store_c) and, with
// BIAS_GRAD, dbias[db_off + i] += sum_z part[S*M*N + z*M + i], in the order
// z = 0..S-1. One invocation per element of (M, N) plus M for the row sums; p.kc
// holds S here.
override WG: u32 = 256u;

@compute @workgroup_size(WG)
fn linear_split_sum(@builtin(local_invocation_index) li: u32,
                    @builtin(workgroup_id) wid: vec3<u32>,
                    @builtin(num_workgroups) nwg: vec3<u32>) {
    if (p.M == 0xffffffffu) {
        c[0] = a[0] + a4[0].x + b[0] + b4[0].x + bias[0] + res[0];
        dbias[0] = 0.0;
    }
    let e = flat_index(wid, nwg, li, WG);
    let S = p.kc;
    let MN = p.M * p.N;
    if (e < MN) {
        var r = 0.0;
        for (var z = 0u; z < S; z++) { r += part[z * MN + e]; }
        let i = e / p.N;
        let j = e % p.N;
        let o = p.c_off + i * p.c_rs + j;
        if (p.has_bias == 1u) { r += bias[p.bias_off + j]; }
        if (p.has_res == 1u) { r += res[i * p.c_rs + j]; }
        if (p.beta == 1u) { r += c[o]; }
        c[o] = r;
    } else if (BIAS_GRAD && e < MN + p.M) {
        let i = e - MN;
        var s = 0.0;
        for (var z = 0u; z < S; z++) { s += part[S * MN + z * p.M + i]; }
        if (DBIAS_IN_C) {
            c[p.db_off + i] = c[p.db_off + i] + s;
        } else {
            dbias[p.db_off + i] = dbias[p.db_off + i] + s;
        }
    }
}

// linear_bias_fill: C[i, j] = bias[j] (+ res[i, j]): linear_split_sum's epilogue over zero
// slices, the same bits, for products accumulated on top of it (linear_f16's out_proj). A
// workgroup takes 256 columns of 4 rows (one column an invocation: coalesced, no division
// per element); flattened grid: column block + ceil(N / 256) x row quad. Bindings 5, 6, 7.
@compute @workgroup_size(256)
fn linear_bias_fill(@builtin(local_invocation_index) li: u32,
                    @builtin(workgroup_id) wid: vec3<u32>,
                    @builtin(num_workgroups) nwg: vec3<u32>) {
    let nb = (p.N + 255u) / 256u;
    let wf = wid.y * nwg.x + wid.x;
    let j = (wf % nb) * 256u + li;
    if (j >= p.N) { return; }
    let bj = bias[p.bias_off + j];
    for (var q = 0u; q < 4u; q++) {
        let i = (wf / nb) * 4u + q;
        if (i < p.M) {
            var r = 0.0;                       // as linear_split_sum: 0 + bias + res
            r += bj;
            if (p.has_res == 1u) { r += res[i * p.c_rs + j]; }
            c[p.c_off + i * p.c_rs + j] = r;
        }
    }
}
