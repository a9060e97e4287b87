"""cgdp's own Python work, counted in bytecodes (deterministic, unlike a clock on a busy machine):
per gradient hook, per ``Trainer`` step and per ``DataParallel`` iteration (README loop with
``clip_grad_norm_``), on 2 CPU-emulated devices, 8 layers of Linear(16, 16), after 3 warm-up steps.

    PYTHONPATH=TREE python bench/python_ops.py      # once per tree: compare two trees' lines

Only code under the imported ``cgdp`` package is counted, on every thread.
"""
import sys, torch, collections
from cgdp.engine.core.hooks import DeviceHooks, StepMarks
ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(8)]
marks = StepMarks(1, len(ps))
h = DeviceHooks(ps, marks, 0, lambda c: None, lambda: 0.0)
views = [torch.zeros(4) for _ in ps]
h.set_layout([0] * 8, views)
marks.set_layout([10**9])
h.mode.streaming = True
for p, v in zip(ps, views):
    p.grad = v
fn = h._make(3, marks, 0)
count = collections.Counter()
def tracer(frame, event, arg):
    frame.f_trace_opcodes = True
    def local(frame, event, arg):
        if event == "opcode":
            count[frame.f_code.co_name] += 1
        return local
    return local
sys.settrace(tracer); fn(ps[3]); sys.settrace(None)
print("bytecodes per hook (streaming, not timed):", sum(count.values()))

# one Trainer step and one DataParallel iteration, caller thread, bytecodes inside cgdp
import cgdp, threading
root = cgdp.__file__.rsplit("/", 1)[0]
def count_in(fn):
    c = collections.Counter()
    def tr(frame, event, arg):
        if not frame.f_code.co_filename.startswith(root):
            return None
        frame.f_trace_opcodes = True
        def local(frame, event, arg):
            if event == "opcode":
                c[0] += 1
            return local
        return local
    threading.settrace(tr); sys.settrace(tr)
    fn()
    sys.settrace(None); threading.settrace(None)
    return c[0]
torch.manual_seed(0)
net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
x, y = torch.randn(8, 16), torch.randint(0, 16, (8,))
with cgdp.Trainer(net, lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1"], chunks=2) as tr:
    for _ in range(3):
        tr.step(x, y, torch.nn.functional.cross_entropy)
    print("bytecodes in cgdp per Trainer step (all threads, G=2, 8 layers):", count_in(lambda: tr.step(x, y, torch.nn.functional.cross_entropy)))
net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
with cgdp.DataParallel(net, ["cpu:0", "cpu:1"], chunks=2) as m:
    opt = m.bind(torch.optim.SGD(m.parameters(), lr=0.1))
    def it():
        opt.zero_grad(); torch.nn.functional.cross_entropy(m(x), y).backward(); m.clip_grad_norm_(1.0); opt.step()
    for _ in range(3):
        it()
    print("bytecodes in cgdp per DataParallel iteration (all threads, G=2, 8 layers):", count_in(it))
