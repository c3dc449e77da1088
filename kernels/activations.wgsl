// activations.wgsl — elementwise kernels: the SiLU gate. The GPU side of
// mamba_ext/cpu/activations.pxd (whose scalar helpers are common.wgsl; softplus
// of dt_proj's output is fused into linear.wgsl's store, its backward into
// scan_backward_grads). common.wgsl is prepended by the loader.
// One invocation per element, over a 2-D grid (flat_index); gate_forward_f16 and
// gate_backward with HALF as below.
//
// Size letters: M = B*L rows, D dInner.
//
// gate_forward bindings: gated = y * SiLU(z), z = Y[:, D:2D]
// | binding | name      | shape   | access                               |
// |---------|-----------|---------|--------------------------------------|
// | 0       | p         | Params  | uniform (n = M*D)                    |
// | 1       | y         | (M, D)  | read (scan output incl. the D_vec skip) |
// | 2       | Y         | (M, 2D) | read (in_proj output [xc | z]; row stride y_rs) |
// | 3       | gated     | (M, D)  | read_write                           |
// gate_forward_f16 (the f16 mode's forward: the gate and the f16 copies the products and
// the backward read, from one read of y and Y): per 64 x 64 tile of (rows, channels),
// gated as gate_forward (the same bits), rounded to f16 (common.wgsl's f16_bits) into
// gated16 row-major and gated16_t transposed (out_proj's operand and its weight
// gradient's, amp.wgsl's amp_pack_f16_pair layout: through a (64, 32)-word tile of
// workgroup memory, so both writes are coalesced), and y and Y rounded to f16 (the
// backward's cache). M and D multiples of 64 (checked on the host); f16 pairs: two per
// word, element e in half e % 2.
// | 1       | y         | (M, D)  | read                                 |
// | 2       | Y         | (M, 2D) | read (row stride y_rs = 2D)          |
// | 3       | y16       | (M, D)  | read_write: f16 of y                 |
// | 4       | Y16       | (M, 2D) | read_write: f16 of Y                 |
// | 5       | gated16   | (M, D)  | read_write: f16 of gated             |
// | 6       | gated16_t | (D, M)  | read_write: its transpose            |
// gate_backward bindings (y and Y f32 or, with HALF, f16 pairs: two per word, element e
// in half e % 2; the f16 mode's cache, read where it is used; then one invocation per
// word, D even):
// | 1       | dgated    | (M, D)  | read                                 |
// | 2       | y         | (M, D)  | read (f32 or f16)                    |
// | 3       | Y         | (M, 2D) | read (f32 or f16)                    |
// | 4       | dy        | (M, D)  | read_write: dgated * SiLU(z)         |
// | 5       | dY        | (M, 2D) | read_write: dY[:, D:2D] = dgated * y * SiLU'(z) (the z half) |
// gate_backward_f16 (the f16 mode's backward: gate_backward with HALF, its dz half written
// as f16 pairs, in_proj's operand, and summed per column from the f32 values, in_proj's
// bias gradient, in the same pass): a workgroup takes 64 channels (32 words, k = li % 32)
// of a row block (rows rb * rows_per .. + rows_per, 8 lanes ly = li / 32 of GB_ROWS rows a
// step, their loads issued together); each invocation sums its rows' dz in row order,
// the 8 lanes are added in the order ly = 0..7 into part[rb, :], and
// reduce.wgsl's column_sum_final adds the row blocks in a fixed order. dgated and dy as f32
// pairs (8-byte accesses); D a multiple of 64.
// | 0       | gp        | GateParams | uniform                           |
// | 1       | dgated    | (M, D)  | read                                 |
// | 2       | y16       | (M, D)  | read: f16 pairs                      |
// | 3       | Y16       | (M, 2D) | read: f16 pairs                      |
// | 4       | dy        | (M, D)  | read_write: dgated * SiLU(z)         |
// | 5       | dY16      | (M, 2D) | read_write: its z half, f16 pairs    |
// | 6       | part      | (RB, D) | read_write: the row blocks' column sums of dz |

struct Params { n: u32, D: u32, y_rs: u32 }

override WG: u32 = 256u;
@group(0) @binding(0) var<uniform> p: Params;

@group(0) @binding(1) var<storage, read> gf_y: array<f32>;
@group(0) @binding(2) var<storage, read> gf_Y: array<f32>;
@group(0) @binding(3) var<storage, read_write> gf_out: array<f32>;

@compute @workgroup_size(WG)
fn gate_forward(@builtin(local_invocation_index) li: u32,
                @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, nwg, li, WG);
    if (i >= p.n) { return; }
    let z = gf_Y[(i / p.D) * p.y_rs + p.D + i % p.D];
    gf_out[i] = gf_y[i] * silu(z);
}

override HALF: bool = false;
@group(0) @binding(1) var<storage, read> gb_dgated: array<f32>;
@group(0) @binding(2) var<storage, read> gb_y: array<u32>;
@group(0) @binding(3) var<storage, read> gb_Y: array<u32>;

@group(0) @binding(4) var<storage, read_write> gb_dy: array<f32>;
@group(0) @binding(5) var<storage, read_write> gb_dY: array<f32>;

@compute @workgroup_size(WG)
fn gate_backward(@builtin(local_invocation_index) li: u32,
                 @builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(num_workgroups) nwg: vec3<u32>) {
    // one element, or with HALF the two of one word of y and of Y (D even)
    let i = flat_index(wid, nwg, li, WG) * select(1u, 2u, HALF);
    if (i >= p.n) { return; }
    let zi = (i / p.D) * p.y_rs + p.D + i % p.D;
    for (var h = 0u; h < select(1u, 2u, HALF); h++) {
        let z = act_value(gb_Y[act_word(zi + h, HALF)], zi + h, HALF);
        let g = gb_dgated[i + h];
        gb_dy[i + h] = g * silu(z);
        gb_dY[zi + h] = g * act_value(gb_y[act_word(i + h, HALF)], i + h, HALF) * dsilu(z);
    }
}

// y and Y as f32 pairs (8-byte loads: the pairs the f16 words are made of)
@group(0) @binding(1) var<storage, read> gh_y: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> gh_Y: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> gh_y16: array<u32>;
@group(0) @binding(4) var<storage, read_write> gh_Y16: array<u32>;
@group(0) @binding(5) var<storage, read_write> gh_gated16: array<u32>;
@group(0) @binding(6) var<storage, read_write> gh_gated16_t: array<u32>;
var<workgroup> gh_tile: array<u32, 64u * 33u>;   // (64, 32) words of gated16, rows 33 apart

@compute @workgroup_size(256)
fn gate_forward_f16(@builtin(local_invocation_index) t: u32,
                    @builtin(workgroup_id) wid: vec3<u32>) {
    let M = p.n / p.D;
    let r0 = wid.y * 64u;                      // this workgroup's 64 rows and 64 channels
    let c0 = wid.x * 64u;
    for (var q = 0u; q < 8u; q++) {            // word k of row r: channels c0 + 2k, 2k + 1
        let r = t / 32u + 8u * q;
        let k = t % 32u;
        let i = (r0 + r) * p.D + c0 + 2u * k;  // element of y, gated
        let e = (r0 + r) * p.y_rs + c0 + 2u * k;   // of Y's xc half; p.D on: z
        let yv = gh_y[i / 2u];
        let xv = gh_Y[e / 2u];
        let zv = gh_Y[(e + p.D) / 2u];
        let v = f16_pair(yv.x * silu(zv.x), yv.y * silu(zv.y));
        gh_y16[i / 2u] = f16_pair(yv.x, yv.y);
        gh_Y16[e / 2u] = f16_pair(xv.x, xv.y);
        gh_Y16[(e + p.D) / 2u] = f16_pair(zv.x, zv.y);
        gh_gated16[i / 2u] = v;
        gh_tile[r * 33u + k] = v;
    }
    workgroupBarrier();
    for (var q = 0u; q < 8u; q++) {            // channel c, word j: rows 2j, 2j + 1
        let c = t / 32u + 8u * q;
        let j = t % 32u;
        let s = 16u * (c % 2u);
        let lo = (gh_tile[(2u * j) * 33u + c / 2u] >> s) & 0xffffu;
        let hi = (gh_tile[(2u * j + 1u) * 33u + c / 2u] >> s) & 0xffffu;
        gh_gated16_t[(c0 + c) * (M / 2u) + r0 / 2u + j] = lo | (hi << 16u);
    }
}

struct GateParams { M: u32, D: u32, rows_per: u32 }
const GB_ROWS: u32 = 4u;     // gate_backward_f16: rows an invocation loads at once
@group(0) @binding(0) var<uniform> gp: GateParams;
@group(0) @binding(1) var<storage, read> g16_dgated: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> g16_y: array<u32>;
@group(0) @binding(3) var<storage, read> g16_Y: array<u32>;
@group(0) @binding(4) var<storage, read_write> g16_dy: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read_write> g16_dY: array<u32>;
@group(0) @binding(6) var<storage, read_write> g16_part: array<f32>;
var<workgroup> g16_red: array<vec2<f32>, 256>;   // (8, 32) the lanes' sums

@compute @workgroup_size(256)
fn gate_backward_f16(@builtin(local_invocation_index) li: u32,
                     @builtin(workgroup_id) wid: vec3<u32>) {
    let k = li % 32u;
    let w = wid.x * 32u + k;                   // the word (channels 2w, 2w + 1) of a row of y16
    let hD = gp.D / 2u;                        // words per row of y16 (of Y16: 2 hD)
    let rb = wid.y;
    let r1 = min(gp.M, (rb + 1u) * gp.rows_per);
    var s = vec2<f32>(0.0);
    for (var r0 = rb * gp.rows_per + (li / 32u) * GB_ROWS; r0 < r1; r0 += 8u * GB_ROWS) {
        var gv: array<vec2<f32>, GB_ROWS>;
        var yw: array<u32, GB_ROWS>;
        var zw: array<u32, GB_ROWS>;
        for (var i = 0u; i < GB_ROWS; i++) {
            let r = min(r0 + i, r1 - 1u);      // (rows past r1 are loaded, not used)
            gv[i] = g16_dgated[r * hD + w];
            yw[i] = g16_y[r * hD + w];
            zw[i] = g16_Y[r * gp.D + hD + w];
        }
        for (var i = 0u; i < GB_ROWS; i++) {
            let r = r0 + i;
            if (r < r1) {
                let z = vec2<f32>(f16_value(zw[i] & 0xffffu), f16_value(zw[i] >> 16u));
                let yv = vec2<f32>(f16_value(yw[i] & 0xffffu), f16_value(yw[i] >> 16u));
                g16_dy[r * hD + w] = gv[i] * vec2<f32>(silu(z.x), silu(z.y));
                let dz = gv[i] * yv * vec2<f32>(dsilu(z.x), dsilu(z.y));   // gate_backward's order
                g16_dY[r * gp.D + hD + w] = f16_pair(dz.x, dz.y);
                s += dz;
            }
        }
    }
    g16_red[li] = s;
    workgroupBarrier();
    if (li < 32u) {
        var t = g16_red[li];
        for (var l = 1u; l < 8u; l++) { t += g16_red[l * 32u + li]; }
        g16_part[rb * gp.D + 2u * w] = t.x;
        g16_part[rb * gp.D + 2u * w + 1u] = t.y;
    }
}
