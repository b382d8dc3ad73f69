import sys

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

src, dst = sys.argv[1:3]
m = onnx.load(src)
g = m.graph
inits = {i.name: i for i in g.initializer}
new_nodes = []
conv = 0
for n in g.node:
    if n.op_type == "MatMul" and n.input[1].endswith(".offsets"):
        name = n.input[1]
        a = nh.to_array(inits[name])
        a16 = a.astype(np.float16)  # timing only
        t = nh.from_array(a16, name + ".f16")
        g.initializer.append(t)
        g.initializer.remove(inits[name])
        new_nodes.append(h.make_node("Cast", [name + ".f16"], [name], to=TP.FLOAT, name=name + ".cast"))
        conv += 1
    new_nodes.append(n)
del g.node[:]
g.node.extend(new_nodes)
print("converted", conv)
onnx.save(m, dst)
