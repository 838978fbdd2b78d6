"""What cuDNN's fusion graphs would take off ResNet-50's step, layer by layer (GPU, needs the
optional ``nvidia-cudnn-frontend`` package).

For every distinct convolution of ResNet-50 at the given batch (fp16, channels_last) it times,
each as the median of windows of CUDA-event-timed repeats:

* today's path: torch's convolution (cuDNN, benchmark mode), our Triton statistics of its output
  (``bnlaunch.statistics``) and, where the convolution reads a BatchNorm + ReLU output that no one
  else reads (a bottleneck's conv2 and conv3), our normalise kernel that makes that input;
  backward: torch's weight and data gradients;
* cuDNN's fusion graphs: the convolution with its output's per-channel sums in the epilogue
  (``genstats``) and, where allowed, scale + bias + ReLU applied to its input as it is loaded
  (so the normalised tensor is never written); the weight gradient with the same prologue; the
  data gradient with the ReLU's gradient and the BatchNorm gradient's two per-channel sums in its
  epilogue.

Each cuDNN graph is built with heuristics A, its first three plans are timed and the fastest kept
(as cuDNN's benchmark mode does for torch). Prints a table per layer and the totals per step
weighted by how often each layer occurs; ``--json`` writes the rows. A graph cuDNN refuses is
reported with its reason, not skipped silently.
"""

import argparse
import json
import statistics as stats
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from imagenet.kernels import bnlaunch  # noqa: E402


PLANS = 3  # the heuristics' first plans built and timed per graph (each may compile a kernel)


def timed(fn, repeats: int = 10, windows: int = 5) -> float:
    """Median ms per call over ``windows`` replays of a CUDA graph of ``repeats`` calls, as the
    training step replays them (eager timing would add each call's host-side launch cost, which
    dwarfs the small layers' kernels); eager, after two warm-up calls, where capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(repeats):
                fn()
        replay = graph.replay
    except Exception:  # not capturable: eager
        torch.cuda.synchronize()

        def replay():
            for _ in range(repeats):
                fn()
    replay()
    times = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    return stats.median(times)


def resnet50_convs(batch: int) -> list:
    """(name, input shape, weight shape, stride, padding, prologue) of every convolution, in order;
    prologue: its input is a BatchNorm + ReLU output read by it alone (a bottleneck's conv2, conv3)."""
    from torchvision.models import resnet50
    model = resnet50().to(memory_format=torch.channels_last)
    rows = []

    def hook(name):
        def record(module, args, _out):
            rows.append((name, tuple(args[0].shape), tuple(module.weight.shape), module.stride, module.padding,
                         name.endswith(("conv2", "conv3")) and "layer" in name))
        return record

    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(hook(name))
    with torch.no_grad():
        model(torch.zeros(batch, 3, 224, 224).to(memory_format=torch.channels_last))
    return rows


class Fused:
    """cuDNN fusion graphs for one convolution shape, built once, fastest plan kept."""

    def __init__(self, cudnn, handle):
        self.cudnn, self.handle = cudnn, handle

    intermediate = "FLOAT"  # the graph's intermediate data type (the variants below try HALF too)

    def _graph(self):
        c = self.cudnn
        return c.pygraph(io_data_type=c.data_type.HALF, intermediate_data_type=getattr(c.data_type, self.intermediate),
                         compute_data_type=c.data_type.FLOAT, handle=self.handle)

    def _finish(self, graph, feeds: dict):
        """Build ``graph``, time each plan, return (run, plans timed, ms of the fastest)."""
        c = self.cudnn
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
        graph.check_support()
        count = graph.get_execution_plan_count()
        best, why = None, ""

        for i in range(min(count, PLANS)):
            try:
                graph.build_plan_at_index(i)
                ws = torch.empty(graph.get_workspace_size_plan_at_index(i), device="cuda", dtype=torch.uint8)

                def run(i=i, ws=ws):
                    self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
                    graph.execute_plan_at_index(feeds, ws, index=i, handle=self.handle)
                ms = timed(run, repeats=5, windows=3)
            except Exception as e:  # a plan that fails to build or run: the next
                why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                continue
            if best is None or ms < best[1]:
                best = (run, ms, graph.get_plan_name_at_index(i))
        if best is None:
            raise RuntimeError(f"none of the {min(count, PLANS)} plans built: {why}")
        return best[0], count, best[1], best[2]

    def _tensor(self, graph, name, t):
        return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=self._dt(t.dtype))

    def _dt(self, dtype):
        c = self.cudnn
        return {torch.float16: c.data_type.HALF, torch.float32: c.data_type.FLOAT,
                torch.bfloat16: c.data_type.BFLOAT16}[dtype]

    def fprop(self, x, w, y, s, b, sums, sqsums, stride, padding, prologue: bool):
        g = self._graph()
        X, W = self._tensor(g, "X", x), self._tensor(g, "W", w)
        feeds = {}
        inp = X
        if prologue:
            S, B = self._tensor(g, "S", s), self._tensor(g, "B", b)
            inp = g.relu(name="relu", input=g.bias(name="bias", input=g.scale(name="scale", input=X, scale=S), bias=B))
            feeds.update({S: s, B: b})
        Y = g.conv_fprop(name="conv", image=inp, weight=W, padding=list(padding), stride=list(stride),
                         dilation=[1, 1])
        Y.set_output(True).set_data_type(self.cudnn.data_type.HALF)
        SUM, SQ = g.genstats(name="genstats", input=Y)
        SUM.set_output(True).set_data_type(self.cudnn.data_type.FLOAT)
        SQ.set_output(True).set_data_type(self.cudnn.data_type.FLOAT)
        feeds.update({X: x, W: w, Y: y, SUM: sums, SQ: sqsums})
        return self._finish(g, feeds)

    def plain_fprop(self, x, w, y, stride, padding):
        g = self._graph()
        X, W = self._tensor(g, "X", x), self._tensor(g, "W", w)
        Y = g.conv_fprop(name="conv", image=X, weight=W, padding=list(padding), stride=list(stride), dilation=[1, 1])
        Y.set_output(True).set_data_type(self.cudnn.data_type.HALF)
        return self._finish(g, {X: x, W: w, Y: y})

    def wgrad(self, x, dy, dw, s, b, stride, padding):
        g = self._graph()
        X, DY = self._tensor(g, "X", x), self._tensor(g, "DY", dy)
        S, B = self._tensor(g, "S", s), self._tensor(g, "B", b)
        a = g.relu(name="relu", input=g.bias(name="bias", input=g.scale(name="scale", input=X, scale=S), bias=B))
        DW = g.conv_wgrad(name="wgrad", image=a, loss=DY, padding=list(padding), stride=list(stride), dilation=[1, 1])
        DW.set_output(True).set_dim(list(dw.shape)).set_stride(list(dw.stride())).set_data_type(
            self.cudnn.data_type.HALF)
        return self._finish(g, {X: x, DY: dy, S: s, B: b, DW: dw})

    def dgrad_drelu_sums(self, dy, w, dx_shape_t, xin, s, b, sum_g, sum_gx, stride, padding):
        """dA = dgrad(dy, w); g = dA * (relu'(xin * s + b)); per channel sum g, sum g * xin."""
        c = self.cudnn
        g = self._graph()
        DY, W = self._tensor(g, "DY", dy), self._tensor(g, "W", w)
        XIN, S, B = self._tensor(g, "XIN", xin), self._tensor(g, "S", s), self._tensor(g, "B", b)
        DA = g.conv_dgrad(name="dgrad", loss=DY, filter=W, padding=list(padding), stride=list(stride), dilation=[1, 1])
        DA.set_dim(list(xin.shape)).set_stride(list(xin.stride()))
        pre = g.bias(name="bias", input=g.scale(name="scale", input=XIN, scale=S), bias=B)
        G = g.relu_backward(name="drelu", loss=DA, input=pre)
        G.set_output(True).set_data_type(c.data_type.HALF)
        SG = g.reduction(name="sum_g", input=G, mode=c.reduction_mode.ADD)
        SG.set_output(True).set_dim(list(sum_g.shape)).set_stride(list(sum_g.stride())).set_data_type(c.data_type.FLOAT)
        GX = g.mul(name="gx", a=G, b=XIN)
        SGX = g.reduction(name="sum_gx", input=GX, mode=c.reduction_mode.ADD)
        SGX.set_output(True).set_dim(list(sum_gx.shape)).set_stride(list(sum_gx.stride())).set_data_type(
            c.data_type.FLOAT)
        return self._finish(g, {DY: dy, W: w, XIN: xin, S: s, B: b, G: dx_shape_t, SG: sum_g, SGX: sum_gx})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--layers", type=int, default=0, help="only the first N distinct layers (0: all)")
    args = p.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    import cudnn
    print(f"cudnn frontend {getattr(cudnn, '__version__', '?')}, backend {cudnn.backend_version_string()}, "
          f"torch's cuDNN {torch.backends.cudnn.version()}", flush=True)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    fused = Fused(cudnn, handle)
    convs = resnet50_convs(args.batch)
    distinct: dict = {}
    for name, xs, ws, stride, padding, prologue in convs:
        key = (xs, ws, stride, padding, prologue)
        distinct.setdefault(key, []).append(name)
    keys = list(distinct)[: args.layers or None]
    cl = dict(memory_format=torch.channels_last)
    rows = []
    t0 = time.time()
    for key in keys:
        xs, ws, stride, padding, prologue = key
        n = len(distinct[key])
        torch.manual_seed(0)
        x = torch.randn(xs, device="cuda", dtype=torch.float16).contiguous(**cl)
        w = (torch.randn(ws, device="cuda", dtype=torch.float16) * (2.0 / (ws[1] * ws[2] * ws[3])) ** 0.5).contiguous(**cl)
        cin, cout = ws[1], ws[0]
        y = F.conv2d(x, w, stride=stride, padding=padding)
        rm, rv = torch.zeros(cout, device="cuda"), torch.ones(cout, device="cuda")
        rm_in, rv_in = torch.zeros(cin, device="cuda"), torch.ones(cin, device="cuda")
        gamma_in, beta_in = torch.rand(cin, device="cuda") + 0.5, torch.randn(cin, device="cuda") * 0.1
        mean_in, invstd_in = bnlaunch.statistics(x, rm_in, rv_in, 0.1, 1e-5)
        scale_in = (gamma_in * invstd_in)
        shift_in = (beta_in - mean_in * scale_in)
        s4 = scale_in.view(1, cin, 1, 1).contiguous(**cl)
        b4 = shift_in.view(1, cin, 1, 1).contiguous(**cl)
        a = bnlaunch.normalise(x, None, mean_in, invstd_in, gamma_in, beta_in, True)[0] if prologue else x
        dy = torch.randn_like(y).contiguous(**cl)
        row = {"layers": ",".join(distinct[key]), "count": n, "input": list(xs), "weight": list(ws),
               "stride": list(stride), "prologue": prologue}
        # today's path
        row["torch_fprop"] = timed(lambda: F.conv2d(a, w, stride=stride, padding=padding))
        row["triton_stats"] = timed(lambda: bnlaunch.statistics(y, rm, rv, 0.1, 1e-5))
        row["triton_apply_in"] = timed(lambda: bnlaunch.normalise(x, None, mean_in, invstd_in, gamma_in, beta_in,
                                                                 True)) if prologue else 0.0
        conv_bwd = torch.ops.aten.convolution_backward
        row["torch_wgrad"] = timed(lambda: conv_bwd(dy, a, w, None, list(stride), list(padding), [1, 1], False,
                                                    [0, 0], 1, [False, True, False]))
        row["torch_dgrad"] = timed(lambda: conv_bwd(dy, a, w, None, list(stride), list(padding), [1, 1], False,
                                                    [0, 0], 1, [True, False, False]))
        if prologue:  # our backward's first pass over (dA, x): the sums the dgrad epilogue would make
            da = torch.randn_like(x).contiguous(**cl)
            row["triton_grad_sums"] = timed(lambda: bnlaunch.gradient_sums(da, x, None, mean_in, invstd_in, gamma_in,
                                                                          beta_in, bnlaunch.MASK_FROM_INPUT))
        # cuDNN's graphs
        yf = torch.empty_like(y)
        sums = torch.empty(1, cout, 1, 1, device="cuda", dtype=torch.float32).contiguous(**cl)
        sqs = torch.empty_like(sums)
        g_out = torch.empty_like(x)
        sg = torch.empty(1, cin, 1, 1, device="cuda", dtype=torch.float32).contiguous(**cl)
        sgx = torch.empty_like(sg)
        # the prologue's scale and shift as fp32 or fp16 tensors, with the graph's intermediate
        # type FLOAT or HALF: the first combination cuDNN builds is kept, every refusal reported
        variants = [(sb, inter) for sb in (torch.float32, torch.float16) for inter in ("FLOAT", "HALF")]
        builds = [("cudnn_plain_fprop", [(None, "FLOAT")], lambda sb: fused.plain_fprop(a, w, yf, stride, padding)),
                  ("cudnn_genstats_fprop", [(None, "FLOAT"), (None, "HALF")],
                   lambda sb: fused.fprop(a, w, yf, s4, b4, sums, sqs, stride, padding, False))]
        if prologue:
            builds += [("cudnn_sbr_genstats_fprop", variants,
                        lambda sb: fused.fprop(x, w, yf, s4.to(sb), b4.to(sb), sums, sqs, stride, padding, True)),
                       ("cudnn_wgrad_sbr", variants,
                        lambda sb: fused.wgrad(x, dy, torch.empty_like(w), s4.to(sb), b4.to(sb), stride, padding)),
                       ("cudnn_dgrad_drelu_sums", variants,
                        lambda sb: fused.dgrad_drelu_sums(dy, w, g_out, x, s4.to(sb), b4.to(sb), sg, sgx, stride,
                                                          padding))]
        for label, tries, build in builds:
            row[label], why = None, []
            for sb, inter in tries:
                fused.intermediate = inter
                try:
                    run, count, ms, plan = build(sb)
                except Exception as e:
                    why.append(f"[{sb} {inter}] {type(e).__name__}: {' '.join(str(e).split())[:400]}")
                    continue
                row[label], row[label + "_plan"] = ms, f"{plan} (of {count}; scale/bias {sb}, intermediate {inter})"
                run()
                torch.cuda.synchronize()
                break
            if row[label] is None:
                row[label + "_why"] = why
            if label.endswith("fprop") and row[label] is not None and label != "cudnn_plain_fprop":
                ref_in = a if label == "cudnn_genstats_fprop" else bnlaunch.normalise(
                    x, None, mean_in, invstd_in, gamma_in, beta_in, True)[0]
                ref = F.conv2d(ref_in, w, stride=stride, padding=padding).float()
                row[label + "_err"] = [float((yf.float() - ref).abs().max() / ref.abs().max()),
                                       float((sums.view(-1) - ref.sum((0, 2, 3))).abs().max()
                                             / ref.abs().sum((0, 2, 3)).max())]
            if label == "cudnn_dgrad_drelu_sums" and row[label] is not None:
                da_ref = conv_bwd(dy, a, w, None, list(stride), list(padding), [1, 1], False, [0, 0], 1,
                                  [True, False, False])[0].float()
                g_ref = torch.where(x.float() * s4.float() + b4.float() > 0, da_ref, 0.0)
                row[label + "_err"] = [float((g_out.float() - g_ref).abs().max() / g_ref.abs().max()),
                                       float((sg.view(-1) - g_ref.sum((0, 2, 3))).abs().max()
                                             / g_ref.abs().sum((0, 2, 3)).max()),
                                       float((sgx.view(-1) - (g_ref * x.float()).sum((0, 2, 3))).abs().max()
                                             / (g_ref * x.float()).abs().sum((0, 2, 3)).max())]
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    print(f"\n{len(rows)} distinct layers in {time.time() - t0:.0f} s", flush=True)

    def total(key):
        return sum((r.get(key) or 0.0) * r["count"] for r in rows)

    print("\nms a step (each layer times its count):")
    for key in ("torch_fprop", "triton_stats", "triton_apply_in", "torch_wgrad", "torch_dgrad", "triton_grad_sums",
                "cudnn_plain_fprop", "cudnn_genstats_fprop", "cudnn_sbr_genstats_fprop", "cudnn_wgrad_sbr",
                "cudnn_dgrad_drelu_sums"):
        missing = sum(r["count"] for r in rows if key in r and r[key] is None)
        print(f"  {key:24s} {total(key):8.3f}" + (f"   ({missing} layers refused)" if missing else ""))
    today = sum((r["torch_fprop"] + r["triton_stats"] + r["triton_apply_in"]) * r["count"] for r in rows)

    def best_forward(r):  # the fastest way each layer's forward could go
        ways = [r["torch_fprop"] + r["triton_stats"] + r["triton_apply_in"]]
        if r.get("cudnn_genstats_fprop") is not None:
            ways.append(r["cudnn_genstats_fprop"] + r["triton_apply_in"])
        if r.get("cudnn_sbr_genstats_fprop") is not None:
            ways.append(r["cudnn_sbr_genstats_fprop"])
        return min(ways)

    fused_f = sum(best_forward(r) * r["count"] for r in rows)
    print(f"\nforward conv + stats + input apply: today {today:.3f} ms, with the fused graphs {fused_f:.3f} ms")
    wg_today = sum(r["torch_wgrad"] * r["count"] for r in rows if r["prologue"])
    wg_fused = sum((r.get("cudnn_wgrad_sbr") or r["torch_wgrad"]) * r["count"] for r in rows if r["prologue"])
    print(f"weight gradients of the prologue layers: torch {wg_today:.3f} ms, SBR wgrad {wg_fused:.3f} ms")
    dg_today = sum((r["torch_dgrad"] + r.get("triton_grad_sums", 0.0)) * r["count"] for r in rows if r["prologue"])
    dg_fused = sum((r.get("cudnn_dgrad_drelu_sums") or (r["torch_dgrad"] + r.get("triton_grad_sums", 0.0)))
                   * r["count"] for r in rows if r["prologue"])
    print(f"data gradient + gradient sums of the prologue layers: today {dg_today:.3f} ms, fused {dg_fused:.3f} ms")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
