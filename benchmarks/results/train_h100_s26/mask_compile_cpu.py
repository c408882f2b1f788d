"""CPU check behind the README's note that Inductor's CPU build of document_block_mask gives
the eager tensors bit for bit (call 8 found the traced mask wrong on the GPU): every index and
count tensor of the BlockMask, compiled against eager, for the GPU probe's document layout.

    PYTHONPATH=src python benchmarks/results/train_h100_s26/mask_compile_cpu.py
"""

import torch

from megacpp.kernels.ops.attention.document import document_block_mask

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def fields(doc_ids):
    mask = document_block_mask(doc_ids)
    return tuple(getattr(mask, f) for f in FIELDS)


doc_ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])
                       for row in ([700, 1, 299, 1048], [2048])])
for name, eager, compiled in zip(FIELDS, fields(doc_ids), torch.compile(fields)(doc_ids),
                                 strict=True):
    print(name, "bit-equal" if torch.equal(eager, compiled) else "DIFFERENT")
