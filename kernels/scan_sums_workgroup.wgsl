// scan_sums_workgroup.wgsl — kernels/scan.wgsl with the per-step sums of
// scan_backward_grads through workgroup memory: the module every device can run
// (mamba_ext/gpu/scan.py compiles it where the subgroup form, scan_sums_subgroup.wgsl,
// does not apply; each file is scan.wgsl and one sum_step).
//
// Each invocation stores its step's dBs | dCs (32 floats of its channel and state group),
// du and ddelta into its row of red (declared in scan.wgsl); every RB steps a barrier, then
// the dBs/dCs partials of the round (sums over HS groups of the workgroup's channels, fixed
// order) and, with SG > 1, du and ddelta (sums over the channel's state groups); a barrier
// after, which also ends the block's staging of Bs | Cs (TS % RB == 0).
//
// Size letters: scan.wgsl's. Bindings: scan.wgsl's (sum_step writes dbc_part, and du and
// ddelta_pre with SG > 1).
//
// #include scan.wgsl

fn sum_step(l: Lane, li: u32, bk: Blk, ts: u32, db: array<vec4<f32>, 4>,
            dc: array<vec4<f32>, 4>, sdu: f32, sdd: f32) {
    let tb = bk.tb;
    let t1 = bk.t1;
    let M = p.B * p.L;
    let kk = TS - 1u - ts;                     // steps of the block done before this one
    let rr = kk / RB;                          // its round
    let k = kk % RB;                           // its row in the round
    let row = (k * WG + li) * RS;
    for (var q = 0u; q < 4u; q++) {
        for (var e = 0u; e < 4u; e++) {
            red[row + 4u * q + e] = db[q][e];
            red[row + 16u + 4u * q + e] = dc[q][e];
        }
    }
    red[row + 32u] = sdu;
    red[row + 33u] = sdd;
    if (k + 1u < RB) { return; }
    workgroupBarrier();
    // dBs, dCs partials of the round: sums over this group's CPW channels
    let cpw = WG / SG / HS;                 // channels per partial
    for (var o2 = li; o2 < HS * RB * SG * 32u; o2 += WG) {
        let hh = o2 / (RB * SG * 32u);     // which partial: channels hh*cpw..
        let o = o2 % (RB * SG * 32u);
        let k = o / (SG * 32u);
        let s = (o / 32u) % SG;
        let jcol = o % 32u;
        let n = s * 16u + jcol % 16u;
        let t = tb + TS - 1u - (rr * RB + k);
        if (t < t1 && n < p.N) {
            // four independent partial sums (a short dependency chain), fixed order
            let i0 = (k * WG + hh * cpw * SG + s) * RS + jcol;
            let st = SG * RS;               // from one channel's row to the next
            var s0 = 0.0; var s1 = 0.0; var s2 = 0.0; var s3 = 0.0;
            var c = 0u;
            for (; c + 3u < cpw; c += 4u) {
                s0 += red[i0 + c * st]; s1 += red[i0 + (c + 1u) * st];
                s2 += red[i0 + (c + 2u) * st]; s3 += red[i0 + (c + 3u) * st];
            }
            for (; c < cpw; c++) { s0 += red[i0 + c * st]; }
            let acc = (s0 + s1) + (s2 + s3);
            dbc_part[((bk.gx * HS + hh) * M + l.b * p.L + t) * 2u * p.N + (jcol / 16u) * p.N + n] = acc;
        }
    }
    if (SG > 1u && l.on && l.s == 0u) {
        // du, ddelta: sums over the channel's state groups (fixed order)
        for (var k = 0u; k < RB; k++) {
            let t = tb + TS - 1u - (rr * RB + k);
            if (t < t1) {
                var su = 0.0;
                var sd = 0.0;
                for (var j2 = 0u; j2 < SG; j2++) {
                    su += red[(k * WG + li + j2) * RS + 32u];
                    sd += red[(k * WG + li + j2) * RS + 33u];
                }
                let r = (l.b * p.L + t) * p.D + l.d;
                du[r] = su + bk.dvec * dy[r];
                ddelta_pre[r] = sd * sigmoid(delta_pre[r]);
            }
        }
    }
    workgroupBarrier();
}
