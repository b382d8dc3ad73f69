import sys

import numpy as np
import onnx

src, dst = sys.argv[1:3]
m = onnx.load(src)
g = m.graph
inits = {i.name: i for i in g.initializer}
shared = {}
for n in g.node:
    if n.op_type == "MatMul" and n.input[1].endswith(".offsets"):
        t = inits[n.input[1]]
        key = tuple(t.dims)
        if key not in shared:
            shared[key] = n.input[1]
        n.input[1] = shared[key]
used = {x for n in g.node for x in n.input}
keep = [i for i in g.initializer if i.name in used or not i.name.endswith(".offsets")]
del g.initializer[:]
g.initializer.extend(keep)
tot = sum(np.prod(inits[v].dims) for v in inits if v.endswith(".offsets"))
print("offset floats total", tot, "MB", tot * 4 / 1e6)
onnx.save(m, dst)
