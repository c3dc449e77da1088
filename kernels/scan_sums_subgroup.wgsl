// scan_sums_subgroup.wgsl — kernels/scan.wgsl with the per-step sums of
// scan_backward_grads through subgroup shuffles, which mamba_ext/gpu/scan.py
// (subgroup_sums) compiles instead of scan_sums_workgroup.wgsl where the device has
// subgroups of SUB = 8, 16 or 32 invocations, each SUB consecutive invocations of a
// workgroup with lane li % SUB (what the device's subgroups are, as the host knows them),
// and SG = 1 (one channel per invocation, so du and ddelta need no sum: pass2_back writes
// them). Dawn needs the `enable subgroups;` directive first: the host's prelude.
//
// Why: the backward is bound by its instructions; the workgroup form stores 34 floats,
// reads 32 and waits at two barriers per step. Here a butterfly sums the 32 values of
// every lane (dBs 16 | dCs 16 of its channel) over the subgroup's SUB channels: at each of
// log2(SUB) stages a lane keeps half of its values (the upper half where its lane bit of
// that stage is set) and adds its partner's copy of that half, so lane j ends with the
// sums of columns j 32/SUB .. (j + 1) 32/SUB - 1: 31 shuffles per lane for SUB = 32, no
// workgroup memory, no barrier. Fixed order (deterministic). Partials: HS = WG / SUB per
// workgroup, one per subgroup (dbc_part; the host sets HS).
//
// Size letters: scan.wgsl's. Bindings: scan.wgsl's (sum_step writes dbc_part).
//
// #include scan.wgsl

fn sum_step(l: Lane, li: u32, bk: Blk, ts: u32, db: array<vec4<f32>, 4>,
            dc: array<vec4<f32>, 4>, sdu: f32, sdd: f32) {
    let lane = li % SUB;
    // 32 -> 16 values: dBs or dCs
    var m = SUB / 2u;
    var up = (lane & m) != 0u;
    var v: array<vec4<f32>, 4>;
    for (var q = 0u; q < 4u; q++) {
        v[q] = select(db[q], dc[q], up) + subgroupShuffleXor(select(dc[q], db[q], up), m);
    }
    // 16 -> 8 -> 4
    m /= 2u;
    up = (lane & m) != 0u;
    let w0 = select(v[0], v[2], up) + subgroupShuffleXor(select(v[2], v[0], up), m);
    let w1 = select(v[1], v[3], up) + subgroupShuffleXor(select(v[3], v[1], up), m);
    m /= 2u;
    up = (lane & m) != 0u;
    var x = select(w0, w1, up) + subgroupShuffleXor(select(w1, w0, up), m);
    // 4 -> 2 -> 1 (SUB 16, 32; uniform: SUB is a constant)
    if (SUB >= 16u) {
        m /= 2u;
        up = (lane & m) != 0u;
        x = vec4<f32>(select(x.xy, x.zw, up) + subgroupShuffleXor(select(x.zw, x.xy, up), m), 0.0, 0.0);
    }
    if (SUB >= 32u) {
        m /= 2u;
        up = (lane & m) != 0u;
        x.x = select(x.x, x.y, up) + subgroupShuffleXor(select(x.y, x.x, up), m);
    }
    let t = bk.tb + ts;
    if (t < bk.t1) {
        let per = 32u / SUB;                   // columns per lane
        let row = (bk.gx * HS + li / SUB) * p.B * p.L + l.b * p.L + t;
        for (var e = 0u; e < per; e++) {
            let col = lane * per + e;          // dBs 0..15 | dCs 16..31
            if (col % 16u < p.N) { dbc_part[row * 2u * p.N + (col / 16u) * p.N + col % 16u] = x[e]; }
        }
    }
}
