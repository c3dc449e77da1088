// linear_f16_ref.wgsl — the product of linear_f16.wgsl (f16 operands, f32 accumulation)
// without subgroup matrices and without the f16 extension: one invocation per element of
// C, the operands' f16 bits decoded by hand. The portable reference of the tensor-core
// kernel, with the same bindings, constants and layouts; mamba_ext.gpu.linear_f16 runs it
// only when asked (linear_f16.REFERENCE), so that the mixed-precision data path (the f16
// copies, the bias start values, the f16 caches) is tested on devices without subgroup
// matrices.
//
//   C[i, j] = C0[i, j] + sum_k A(i, k) * B(k, j), k = 0 .. KLEN-1 in order, C0 as in
//   linear_f16.wgsl: C (ACCUMULATE), else bias[j] (INIT_BIAS), else 0; SCALED as there:
//   k in segments of KSEG over A's planes hi, hi, lo and B's hi, lo, hi, and
//   C[i, j] = (C0[i, j] sA sB + sum_k ...) / sA / sB (sA, 1/sA at sc[SA]; sB, 1/sB at sc[SB])
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
// | 5       | sc   | f32 scales (SCALED)                  | read       |

struct Params {
    a_off : u32, b_off : u32, c_off : u32, bias_off : u32,
}

@group(0) @binding(0) var<uniform> p : Params;
@group(0) @binding(1) var<storage, read> a : array<u32>;
@group(0) @binding(2) var<storage, read> b : array<u32>;
@group(0) @binding(3) var<storage, read_write> c : array<f32>;
@group(0) @binding(4) var<storage, read> bias : array<f32>;
@group(0) @binding(5) var<storage, read> sc : array<f32>;

fn a_at(e : u32) -> f32 { return f16_value((a[e / 2u] >> (16u * (e % 2u))) & 0xffffu); }
fn b_at(e : u32) -> f32 { return f16_value((b[e / 2u] >> (16u * (e % 2u))) & 0xffffu); }

@compute @workgroup_size(16, 16)
fn linear_f16_product(@builtin(global_invocation_id) gid : vec3<u32>) {
    if (p.bias_off == 0xffffffffu) { c[0] = bias[0] + sc[SA]; }   // never: keeps bindings 4, 5
    let i = gid.y;
    let j = gid.x;
    if (j >= NVALID) { return; }
    var s = 0.0;
    for (var kk = 0u; kk < KLEN; kk++) {
        // k of the whole product, and (SCALED) its place in its segment's planes
        var k = gid.z * KLEN + kk;
        var a_off = p.a_off;
        var b_off = p.b_off;
        if (SCALED) {
            a_off += select(0u, 8u * PLANE_A, k / KSEG == 2u);
            b_off += select(0u, 8u * PLANE_B, k / KSEG == 1u);
            k = k % KSEG;
        }
        let ea = select(a_off + k * LDA + i, a_off + i * LDA + k, A_KMAJOR);
        let eb = select(b_off + k * LDB + j, b_off + j * LDB + k, B_KMAJOR);
        s += a_at(ea) * b_at(eb);
    }
    let at = p.c_off + gid.z * CSLICE + select(i * LDC + j, j * LDC + i, C_COLMAJOR);
    var s0 = 0.0;
    if (ACCUMULATE) { s0 = c[at]; }
    if (INIT_BIAS) { s0 = bias[p.bias_off + j]; }
    if (SCALED) { s0 = s0 * sc[SA] * sc[SB]; }      // (the host never accumulates SCALED)
    s = s0 + s;                      // (the start value added last, as before SCALED)
    if (SCALED) { s = s * sc[SA + 1u] * sc[SB + 1u]; }
    c[at] = s;
}
