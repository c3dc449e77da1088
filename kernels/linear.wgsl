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
// Tile: BM x BN = 128 x 128 outputs per workgroup of 16 x 16 invocations; each
// invocation holds an 8 x 8 micro-tile (rows 4ty..4ty+3 and 64+4ty.., columns
// 4tx.. and 64+4tx..) in 16 named vec4 registers (no private arrays: dynamically
// indexed ones spill to local memory). k advances in steps of BK = 16 through
// workgroup memory. PREFETCH: the next step's operands are loaded into
// registers while this step is computed, then stored into the other buffer
// (STAGES = 2, one barrier per step) or, after a barrier, into the same one
// (STAGES = 1, 16 KiB: the default, measured faster on an H200, see
// mamba_ext/gpu/linear.py). Both operands are kept k-major in
// workgroup memory (As[k][i], Bs[k][j], 32 vec4 per k) with the vec4 slot of
// row group s stored at s ^ swz(k), swz(k) = 2 * ((k / 4) % 4): the transposing
// scalar stores of a k-contiguous operand then hit 32 different banks, and the
// compute loop's reads stay conflict-free (broadcast for A, 16 consecutive
// vec4 for B). Out-of-range rows, columns and k are zero-filled on load and
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
override SPLIT: bool = false;
override STAGES: u32 = 2u;
// PREFETCH: double buffering through registers (see gemm_tile); off = the plain loop.
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
const STAGE: u32 = BK * SLOTS;          // vec4 per buffer (2048 floats = 8 KiB)

var<workgroup> As: array<vec4<f32>, STAGES * STAGE>;   // (STAGES, BK, 128) A tile, k-major
var<workgroup> Bs: array<vec4<f32>, STAGES * STAGE>;   // (STAGES, BK, 128) B tile, k-major

fn swz(k: u32) -> u32 { return ((k >> 2u) & 3u) << 1u; }

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

// The r-th (0, 1) vec4 this invocation loads of a tile: (row or column, k) in the tile.
// KFAST: v = tid + 256 r -> row v / 4, k 4 * (v % 4); else k v / 32, row group v % 32.
fn tile_pos(tid: u32, r: u32, kfast: bool) -> vec2<u32> {
    let v = tid + 256u * r;
    if (kfast) { return vec2<u32>(v >> 2u, (v & 3u) << 2u); }
    return vec2<u32>((v & 31u) << 2u, v >> 5u);
}

fn store_a(st: u32, pos: vec2<u32>, v: vec4<f32>) {
    if (A_KFAST) {
        for (var q = 0u; q < 4u; q++) {
            let k = pos.y + q;
            As[st * STAGE + k * SLOTS + ((pos.x >> 2u) ^ swz(k))][pos.x & 3u] = v[q];
        }
    } else {
        As[st * STAGE + pos.y * SLOTS + ((pos.x >> 2u) ^ swz(pos.y))] = v;
    }
}

fn store_b(st: u32, pos: vec2<u32>, v: vec4<f32>) {
    if (B_KFAST) {
        for (var q = 0u; q < 4u; q++) {
            let k = pos.y + q;
            Bs[st * STAGE + k * SLOTS + ((pos.x >> 2u) ^ swz(k))][pos.x & 3u] = v[q];
        }
    } else {
        Bs[st * STAGE + pos.y * SLOTS + ((pos.x >> 2u) ^ swz(pos.y))] = v;
    }
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
    let pa0 = tile_pos(tid, 0u, A_KFAST);
    let pa1 = tile_pos(tid, 1u, A_KFAST);
    let pb0 = tile_pos(tid, 0u, B_KFAST);
    let pb1 = tile_pos(tid, 1u, B_KFAST);
    // The 8 x 8 micro-tile of this invocation: rows 4ty+r (c0r..c3r) and 64+4ty+r
    // (c4r..c7r), columns 4tx.. (cr0) and 64+4tx.. (cr1); rs0/rs1: row sums of A
    // (BIAS_GRAD). Function-local named variables (registers), updated in this one
    // function: no private arrays and no module-scope state for the driver to keep
    // in memory.
    var c00 = vec4<f32>(0.0); var c01 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0); var c11 = vec4<f32>(0.0);
    var c20 = vec4<f32>(0.0); var c21 = vec4<f32>(0.0);
    var c30 = vec4<f32>(0.0); var c31 = vec4<f32>(0.0);
    var c40 = vec4<f32>(0.0); var c41 = vec4<f32>(0.0);
    var c50 = vec4<f32>(0.0); var c51 = vec4<f32>(0.0);
    var c60 = vec4<f32>(0.0); var c61 = vec4<f32>(0.0);
    var c70 = vec4<f32>(0.0); var c71 = vec4<f32>(0.0);
    var rs0 = vec4<f32>(0.0); var rs1 = vec4<f32>(0.0);
    // PREFETCH: the next step's operands are loaded into registers while this step is
    // computed, then stored into the other buffer (STAGES = 2: one barrier a step) or,
    // after a barrier, into the same one (STAGES = 1). Off: the plain loop (load,
    // store, barrier, compute, barrier; buffer 0 only, fewer live registers).
    var ra0 = vec4<f32>(0.0); var ra1 = vec4<f32>(0.0);
    var rb0 = vec4<f32>(0.0); var rb1 = vec4<f32>(0.0);
    if (PREFETCH) {
        ra0 = load_a(row0 + pa0.x, kbeg + pa0.y, kend);
        ra1 = load_a(row0 + pa1.x, kbeg + pa1.y, kend);
        rb0 = load_b(col0 + pb0.x, kbeg + pb0.y, kend);
        rb1 = load_b(col0 + pb1.x, kbeg + pb1.y, kend);
        store_a(0u, pa0, ra0); store_a(0u, pa1, ra1);
        store_b(0u, pb0, rb0); store_b(0u, pb1, rb1);
        workgroupBarrier();
    }
    var st = 0u;
    for (var k0 = kbeg; k0 < kend; k0 += BK) {
        let more = k0 + BK < kend;                // uniform
        if (!PREFETCH) {
            store_a(0u, pa0, load_a(row0 + pa0.x, k0 + pa0.y, kend));
            store_a(0u, pa1, load_a(row0 + pa1.x, k0 + pa1.y, kend));
            store_b(0u, pb0, load_b(col0 + pb0.x, k0 + pb0.y, kend));
            store_b(0u, pb1, load_b(col0 + pb1.x, k0 + pb1.y, kend));
            workgroupBarrier();
        } else if (more) {
            let kn = k0 + BK;
            ra0 = load_a(row0 + pa0.x, kn + pa0.y, kend);
            ra1 = load_a(row0 + pa1.x, kn + pa1.y, kend);
            rb0 = load_b(col0 + pb0.x, kn + pb0.y, kend);
            rb1 = load_b(col0 + pb1.x, kn + pb1.y, kend);
        }
        // One BK step of the micro-tile from workgroup buffer st.
        for (var kk = 0u; kk < BK; kk++) {
            let sw = swz(kk);
            let base = st * STAGE + kk * SLOTS;
            let a0 = As[base + (ty ^ sw)];
            let a1 = As[base + ((ty + 16u) ^ sw)];
            let b0 = Bs[base + (tx ^ sw)];
            let b1 = Bs[base + ((tx + 16u) ^ sw)];
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
        if (PREFETCH && more) {
            var nst = st ^ 1u;
            if (STAGES == 1u) {
                workgroupBarrier();               // one buffer: everyone done reading it
                nst = 0u;
            }
            store_a(nst, pa0, ra0); store_a(nst, pa1, ra1);
            store_b(nst, pb0, rb0); store_b(nst, pb1, rb1);
            st = nst;
        }
        workgroupBarrier();
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
        dbias[p.db_off + i] = dbias[p.db_off + i] + s;
    }
}
