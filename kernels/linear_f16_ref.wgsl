// linear_f16_ref.wgsl — the product of linear_f16.wgsl (f16 operands, f32 accumulation)
// without subgroup matrices and without the f16 extension: one invocation per element of
// C, the operands' f16 bits decoded by hand. The portable reference of the tensor-core
// kernel, with the same bindings, constants and layouts; mamba_ext.gpu.linear_f16 runs it
// only when asked (linear_f16.REFERENCE), so that the mixed-precision data path (the f16
// copies, the bias start values, the f16 caches) is tested on devices without subgroup
// matrices.
//
//   C[i, j] = C0[i, j] + sum_k A(i, k) * B(k, j), k = 0 .. KLEN-1 in order, C0 as in
//   linear_f16.wgsl: C (ACCUMULATE), else bias[j] (INIT_BIAS), else 0
//
// Split-K as in linear_f16.wgsl: grid layer z takes k = z*KLEN .. (z+1)*KLEN - 1 and
// writes its C at c_off + z*CSLICE.
//
// Size letters: M rows, N columns (grid x 16 by y 16), KLEN contraction. Layouts as in
// linear_f16.wgsl: A_KMAJOR: A(i, k) = a[a_off + i*LDA + k], else a[a_off + k*LDA + i];
// B_KMAJOR: B(k, j) = b[b_off + j*LDB + k], else b[b_off + k*LDB + j] (f16 elements);
// C[i, j] = c[c_off + i*LDC + j] (C_COLMAJOR: c[c_off + j*LDC + i]), bias[j] =
// bias[bias_off + j] (f32); columns j >= NVALID are neither computed nor stored.
//
// Bindings:
// | binding | name | shape                                | access     |
// |---------|------|--------------------------------------|------------|
// | 0       | p    | Params: a_off, b_off, c_off, bias_off | uniform   |
// | 1       | a    | A operand, f16 packed 2 per u32      | read       |
// | 2       | b    | B operand, f16 packed 2 per u32      | read       |
// | 3       | c    | C (M, N) f32                         | read_write |
// | 4       | bias | bias (N,) f32                        | read       |

struct Params {
    a_off : u32, b_off : u32, c_off : u32, bias_off : u32,
}

@group(0) @binding(0) var<uniform> p : Params;
@group(0) @binding(1) var<storage, read> a : array<u32>;
@group(0) @binding(2) var<storage, read> b : array<u32>;
@group(0) @binding(3) var<storage, read_write> c : array<f32>;
@group(0) @binding(4) var<storage, read> bias : array<f32>;

fn a_at(e : u32) -> f32 { return f16_value((a[e / 2u] >> (16u * (e % 2u))) & 0xffffu); }
fn b_at(e : u32) -> f32 { return f16_value((b[e / 2u] >> (16u * (e % 2u))) & 0xffffu); }

@compute @workgroup_size(16, 16)
fn linear_f16_product(@builtin(global_invocation_id) gid : vec3<u32>) {
    if (p.bias_off == 0xffffffffu) { c[0] = bias[0]; }   // never: keeps binding 4 in the layout
    let i = gid.y;
    let j = gid.x;
    if (j >= NVALID) { return; }
    let a_off = p.a_off + gid.z * select(KLEN * LDA, KLEN, A_KMAJOR);
    let b_off = p.b_off + gid.z * select(KLEN * LDB, KLEN, B_KMAJOR);
    var s = 0.0;
    for (var k = 0u; k < KLEN; k++) {
        let ea = select(a_off + k * LDA + i, a_off + i * LDA + k, A_KMAJOR);
        let eb = select(b_off + k * LDB + j, b_off + j * LDB + k, B_KMAJOR);
        s += a_at(ea) * b_at(eb);
    }
    let at = p.c_off + gid.z * CSLICE + select(i * LDC + j, j * LDC + i, C_COLMAJOR);
    if (ACCUMULATE) { s += c[at]; }
    if (INIT_BIAS) { s += bias[p.bias_off + j]; }
    c[at] = s;
}
