// linear.wgsl — tiled matrix product of every linear layer (in_proj, x_proj,
// dt_proj, out_proj, the tied LM head), forward and backward. The GPU side of
// mamba_ext/cpu/linear.pyx. common.wgsl is prepended by the loader.
//
// Size letters: B batch, L seqLen, Dm dModel, D dInner, R dtRank, P = R + 2N,
// M = B*L rows, V vocab. In this file the product itself is (rows x cols) with
// contraction length K_c: Params.M rows, Params.N columns, Params.K (not dConv).
//
//   C[i, j] = beta * C[i, j] + sum_k A(i, k) * B(k, j) (+ bias[j]) (+ res[i, j])
//   A(i, k) = a[a_off + i*a_rs + k*a_cs], B(k, j) = b[b_off + k*b_rs + j*b_cs],
//   C[i, j] = c[c_off + i*c_rs + j],  res[i, j] = res[i*c_rs + j]
//
// Strides let one kernel serve the three products of a linear layer
// Y = X W^T + b with X (M, I), W (O, I), Y (M, O):
//   linear_forward   Y  = X  @ W^T (+ b) (+ residual): A = X (rs I, cs 1), B = W^T (rs 1, cs I)
//   linear_backward  dX += dY @ W   : A = dY (rs O, cs 1), B = W (rs I, cs 1)
//   linear_backward  dW += dY^T @ X : A = dY^T (rs 1, cs O), B = X (rs I, cs 1)
// (the bias gradient is a column sum: reduce.wgsl's column_sum), and column
// slices (x_proj's dt_low | Bs | Cs columns, in_proj's xc | z halves) by offsets
// and row strides. dW is a product, not a scatter: no float atomics, every
// output element is summed by one invocation in a fixed k order.
//
// Bindings (both entry points; shapes in elements, strides as above):
// | binding | name | shape             | access     |
// |---------|------|-------------------|------------|
// | 0       | p    | Params            | uniform    |
// | 1       | a    | A operand (M, K)  | read       |
// | 2       | b    | B operand (K, N)  | read       |
// | 3       | bias | (N) at bias_off   | read       | (used when has_bias = 1)
// | 4       | res  | (M, N), stride c_rs | read     | (used when has_res = 1: out_proj's residual x)
// | 5       | c    | C output (M, N)   | read_write |
// Tile: 64 x 64 outputs per workgroup of 16x16 invocations, each invocation a
// 4 x 4 block (rows 4*ty.., columns 4*tx..) held in four vec4 registers; k in
// steps of BK = 16 through workgroup memory. The inner loop is written out by
// hand (no private arrays: dynamically indexed ones spill to local memory, and
// that made this kernel 20x slower on an H200). Out-of-range rows/columns/k
// are zero-filled on load and skipped on store, so no size needs to be a
// multiple of a tile.

struct Params {
    M: u32, N: u32, K: u32,
    a_off: u32, a_rs: u32, a_cs: u32,
    b_off: u32, b_rs: u32, b_cs: u32,
    c_off: u32, c_rs: u32,
    bias_off: u32, has_bias: u32, beta: u32, has_res: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read> res: array<f32>;
@group(0) @binding(5) var<storage, read_write> c: array<f32>;

const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 16u;

var<workgroup> As: array<vec4<f32>, 272>;   // As[k*17 + i/4][i%4]  (BK, BM), row padded: no bank conflicts
var<workgroup> Bs: array<vec4<f32>, 272>;   // Bs[k*17 + j/4][j%4]  (BK, BN)

fn load_a(i: u32, k: u32) -> f32 {
    if (i < p.M && k < p.K) { return a[p.a_off + i * p.a_rs + k * p.a_cs]; }
    return 0.0;
}

fn load_b(k: u32, j: u32) -> f32 {
    if (j < p.N && k < p.K) { return b[p.b_off + k * p.b_rs + j * p.b_cs]; }
    return 0.0;
}

fn store(i: u32, j0: u32, v: vec4<f32>) {
    if (i >= p.M) { return; }
    let base = p.c_off + i * p.c_rs;
    for (var q = 0u; q < 4u; q++) {
        let j = j0 + q;
        if (j < p.N) {
            var r = v[q];
            if (p.has_bias == 1u) { r += bias[p.bias_off + j]; }
            if (p.has_res == 1u) { r += res[i * p.c_rs + j]; }
            if (p.beta == 1u) { r += c[base + j]; }
            c[base + j] = r;
        }
    }
}

fn gemm_tile(lid: vec3<u32>, wid: vec3<u32>) {
    let row0 = wid.y * BM;
    let col0 = wid.x * BN;
    let tid = lid.y * 16u + lid.x;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    // Load mapping: each invocation fills one vec4 of As and one of Bs per
    // k-step. When the operand is contiguous along k (a_cs == 1 / b_rs == 1)
    // neighbouring invocations take neighbouring k (coalesced reads);
    // otherwise neighbouring i / j.
    let a_kfast = p.a_cs == 1u;
    let b_kfast = p.b_rs == 1u;
    for (var k0 = 0u; k0 < p.K; k0 += BK) {
        {
            // As slot s = tid: k = s / 16, i4 = s % 16 (4 rows 4*i4..4*i4+3)
            var k = tid / 16u;
            var i4 = tid % 16u;
            if (a_kfast) { k = tid % 16u; i4 = tid / 16u; }
            let i = row0 + 4u * i4;
            let gk = k0 + k;
            As[k * 17u + i4] = vec4<f32>(load_a(i, gk), load_a(i + 1u, gk),
                                         load_a(i + 2u, gk), load_a(i + 3u, gk));
            var kb = tid / 16u;
            var j4 = tid % 16u;
            if (b_kfast) { kb = tid % 16u; j4 = tid / 16u; }
            let j = col0 + 4u * j4;
            let gkb = k0 + kb;
            Bs[kb * 17u + j4] = vec4<f32>(load_b(gkb, j), load_b(gkb, j + 1u),
                                          load_b(gkb, j + 2u), load_b(gkb, j + 3u));
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            let av = As[kk * 17u + lid.y];
            let bv = Bs[kk * 17u + lid.x];
            acc0 = fma(vec4<f32>(av.x), bv, acc0);
            acc1 = fma(vec4<f32>(av.y), bv, acc1);
            acc2 = fma(vec4<f32>(av.z), bv, acc2);
            acc3 = fma(vec4<f32>(av.w), bv, acc3);
        }
        workgroupBarrier();
    }
    let i = row0 + 4u * lid.y;
    let j = col0 + 4u * lid.x;
    store(i, j, acc0);
    store(i + 1u, j, acc1);
    store(i + 2u, j, acc2);
    store(i + 3u, j, acc3);
}

// The forward and backward products are the same tile code; two entry points
// so that each dispatch is named after its step.
@compute @workgroup_size(16, 16)
fn linear_forward(@builtin(local_invocation_id) lid: vec3<u32>,
                  @builtin(workgroup_id) wid: vec3<u32>) {
    gemm_tile(lid, wid);
}

@compute @workgroup_size(16, 16)
fn linear_backward(@builtin(local_invocation_id) lid: vec3<u32>,
                   @builtin(workgroup_id) wid: vec3<u32>) {
    gemm_tile(lid, wid);
}
