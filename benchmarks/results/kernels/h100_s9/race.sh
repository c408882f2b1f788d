# racecheck of _fwd_state alone at num_stages 1 and 2 (small shape)
cat > /tmp/one.py <<'PY'
import sys, os
sys.path.insert(0, os.getcwd())
import torch
import megacpp.kernels.ops.gated_delta.triton as gd
from tests.kernels.test_gated_delta_triton import make_inputs
gd.CONFIG["fwd_state"] = {**gd.CONFIG["fwd_state"], "BV": 32, "num_stages": int(sys.argv[1])}
x = make_inputs(1, 256, 1, 128, 128, device="cuda", seed=3)
q, k, v = (x[n].to(torch.bfloat16) for n in "qkv")
o, s = gd.gated_delta_rule_triton(q, k, v, x["g"], x["beta"])
torch.cuda.synchronize()
print("stages", sys.argv[1], "o", float(o.float().norm()), "state", float(s.norm()))
PY
for st in 1 2; do timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 4 python /tmp/one.py $st 2>&1 | grep -v -i warn | tail -12; done
