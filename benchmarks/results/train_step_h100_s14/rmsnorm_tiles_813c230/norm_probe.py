"""RMSNorm kernels at the training step's shapes: GPU time per launch (CUDA graph of 20
launches, replayed) and GB/s, for several tile settings. Direct launches of the tree's kernels."""
import json, sys
import torch, triton
from megacpp.kernels.ops.rmsnorm import triton as rt

SM = torch.cuda.get_device_properties(0).multi_processor_count
# (name, rows, dim, x dtype, y dtype, dh_out): the step's norm calls
SHAPES = [("block D768 fp32->bf16 skip", 16384, 768, torch.float32, torch.bfloat16, True),
          ("final D768 fp32->bf16", 16384, 768, torch.float32, torch.bfloat16, False),
          ("q-norm 12x64 bf16", 16384 * 12, 64, torch.bfloat16, torch.bfloat16, False),
          ("k-norm 2x64 bf16", 16384 * 2, 64, torch.bfloat16, torch.bfloat16, False),
          ("B/C-norm 1x64 bf16", 16384, 64, torch.bfloat16, torch.bfloat16, False)]


def graph_time(fn, n=20):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / n)
    return sorted(ts)[3]


out = []
for name, T, D, xd, yd, has_dh in SHAPES:
    x = torch.randn(T, D, device="cuda", dtype=xd)
    w = torch.ones(D, device="cuda")
    y = torch.empty(T, D, device="cuda", dtype=yd)
    rstd = torch.empty(T, device="cuda")
    dy = torch.randn(T, D, device="cuda", dtype=yd)
    dho = torch.randn(T, D, device="cuda", dtype=xd)
    dh = torch.empty_like(x)
    block, warps = rt._block(D)
    fbytes = T * D * (xd.itemsize + yd.itemsize)
    bbytes = T * D * (yd.itemsize + xd.itemsize * (3 if has_dh else 2))
    for rows in (1, 2, 4, 8, 16, 32, 64):
        if rows * block > 8192:
            continue
        for wp in sorted({warps, max(1, warps // 2), min(16, warps * 2), 4}):
            t = graph_time(lambda: rt._rmsnorm_fwd[(triton.cdiv(T, rows),)](
                x, x, w, y, x, rstd, T, D, 1e-5, HAS_RESIDUAL=False, ROWS=rows, BLOCK=block,
                num_warps=wp))
            out.append(dict(shape=name, kind="fwd", rows=rows, warps=wp, us=t, gbs=fbytes / t / 1e3))
    for tile in (1, 2, 4, 8, 16, 32):
        if tile * block > 8192:
            continue
        for pps in (2, 4, 8, 16):
            n_prog = min(T, pps * SM)
            rpp = triton.cdiv(T, n_prog); n_prog = triton.cdiv(T, rpp)
            part = torch.empty(n_prog, D, device="cuda")
            for wp in sorted({warps, max(1, warps // 2), 4}):
                def bwd():
                    rt._rmsnorm_bwd[(n_prog,)](dy, dho, x, w, rstd, dh, part, T, D, ROWS=rpp,
                                               HAS_DH_OUT=has_dh, TILE=tile, BLOCK=block,
                                               num_warps=wp)
                    part.sum(0)
                t = graph_time(bwd)
                out.append(dict(shape=name, kind="bwd", tile=tile, pps=pps, warps=wp, us=t,
                                gbs=bbytes / t / 1e3))
    cur_f = [r for r in out if r["shape"] == name and r["kind"] == "fwd" and r["rows"] == rt._tile_rows(rt.FWD_ROWS, block) and r["warps"] == warps]
    cur_b = [r for r in out if r["shape"] == name and r["kind"] == "bwd" and r["tile"] == rt._tile_rows(rt.BWD_TILE, block) and r["pps"] == rt.BWD_PROGRAMS_PER_SM and r["warps"] == warps]
    best_f = min((r for r in out if r["shape"] == name and r["kind"] == "fwd"), key=lambda r: r["us"])
    best_b = min((r for r in out if r["shape"] == name and r["kind"] == "bwd"), key=lambda r: r["us"])
    print(f"{name:28s} fwd now {cur_f[0]['us']:7.1f} us ({cur_f[0]['gbs']:5.0f} GB/s) best {best_f['us']:7.1f} {best_f}", flush=True)
    print(f"{'':28s} bwd now {cur_b[0]['us']:7.1f} us ({cur_b[0]['gbs']:5.0f} GB/s) best {best_b['us']:7.1f} {best_b}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=0)
