// linear.wgsl — tiled matrix product for every linear layer, forward and backward.
//
//   C[i, j] = beta * C[i, j] + sum_k A(i, k) * B(k, j) (+ bias[j])
//   A(i, k) = a[a_off + i*a_rs + k*a_cs], B(k, j) = b[b_off + k*b_rs + j*b_cs],
//   C[i, j] = c[c_off + i*c_rs + j]
//
// Strides let one kernel serve the three products of a linear layer
// Y = X W^T + b with X (M, I), W (O, I), Y (M, O):
//   forward   Y  = X  @ W^T : A = X (rs I, cs 1),  B = W^T (rs 1, cs I)
//   backward  dX += dY @ W  : A = dY (rs O, cs 1), B = W (rs I, cs 1)
//   backward  dW += dY^T @ X: A = dY^T (rs 1, cs O), B = X (rs I, cs 1)
// and column slices (x_proj's dt | B | C columns, in_proj's x | z halves) by
// offsets and row strides. dW is a product, not a scatter: no float atomics,
// every output element is summed by one invocation in a fixed k order.
//
// Binding table (sizes as elements; M rows, N columns, K contraction here):
//   0 p     uniform  Params
//   1 a     (..)     read        A operand (any strides)
//   2 b     (..)     read        B operand (any strides)
//   3 bias  (..)     read        bias at bias_off (N) when has_bias = 1
//   4 c     (..)     read_write  C output, row stride c_rs, column stride 1
// Tile: BM = 16*TM rows x BN = 16*TN columns per workgroup of 16x16, BK = 16.
// Out-of-range rows/columns/k are zero-filled on load and skipped on store, so
// no size needs to be a multiple of a tile.

struct Params {
    M: u32, N: u32, K: u32,
    a_off: u32, a_rs: u32, a_cs: u32,
    b_off: u32, b_rs: u32, b_cs: u32,
    c_off: u32, c_rs: u32,
    bias_off: u32, has_bias: u32, beta: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> c: array<f32>;

override TM: u32 = 4u;   // rows per invocation (TM * TN <= 64)
override TN: u32 = 4u;   // columns per invocation
const BK: u32 = 16u;

var<workgroup> As: array<f32, BK * 16u * TM>;   // As[k][i]  (BK, BM)
var<workgroup> Bs: array<f32, BK * 16u * TN>;   // Bs[k][j]  (BK, BN)

@compute @workgroup_size(16, 16)
fn linear_gemm(@builtin(local_invocation_id) lid: vec3<u32>,
               @builtin(workgroup_id) wid: vec3<u32>) {
    let BM = 16u * TM;
    let BN = 16u * TN;
    let row0 = wid.y * BM;
    let col0 = wid.x * BN;
    let tid = lid.y * 16u + lid.x;
    var acc: array<f32, 64>;
    for (var q = 0u; q < TM * TN; q++) { acc[q] = 0.0; }
    var ar: array<f32, 8>;
    var br: array<f32, 8>;

    for (var k0 = 0u; k0 < p.K; k0 += BK) {
        // Load the tiles; consecutive invocations read consecutive addresses
        // of whichever dimension is contiguous in memory.
        for (var l = tid; l < BM * BK; l += 256u) {
            var i: u32; var k: u32;
            if (p.a_cs == 1u) { i = l / BK; k = l % BK; } else { k = l / BM; i = l % BM; }
            let gi = row0 + i;
            let gk = k0 + k;
            var v = 0.0;
            if (gi < p.M && gk < p.K) { v = a[p.a_off + gi * p.a_rs + gk * p.a_cs]; }
            As[k * BM + i] = v;
        }
        for (var l = tid; l < BN * BK; l += 256u) {
            var j: u32; var k: u32;
            if (p.b_cs == 1u) { k = l / BN; j = l % BN; } else { j = l / BK; k = l % BK; }
            let gj = col0 + j;
            let gk = k0 + k;
            var v = 0.0;
            if (gj < p.N && gk < p.K) { v = b[p.b_off + gk * p.b_rs + gj * p.b_cs]; }
            Bs[k * BN + j] = v;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            for (var r = 0u; r < TM; r++) { ar[r] = As[kk * BM + lid.y + 16u * r]; }
            for (var q = 0u; q < TN; q++) { br[q] = Bs[kk * BN + lid.x + 16u * q]; }
            for (var r = 0u; r < TM; r++) {
                for (var q = 0u; q < TN; q++) {
                    acc[r * TN + q] = fma(ar[r], br[q], acc[r * TN + q]);
                }
            }
        }
        workgroupBarrier();
    }

    for (var r = 0u; r < TM; r++) {
        let i = row0 + lid.y + 16u * r;
        if (i >= p.M) { continue; }
        for (var q = 0u; q < TN; q++) {
            let j = col0 + lid.x + 16u * q;
            if (j >= p.N) { continue; }
            var v = acc[r * TN + q];
            if (p.has_bias == 1u) { v += bias[p.bias_off + j]; }
            let ci = p.c_off + i * p.c_rs + j;
            if (p.beta == 1u) { v += c[ci]; }
            c[ci] = v;
        }
    }
}
