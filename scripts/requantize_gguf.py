"""Write a copy of a GGUF file with its quantized tensors re-encoded as Q8_0 or F16 (through f32).

Used to make a target/draft pair out of one checkpoint for speculative decoding measurements (e.g.
SmolLM2-135M Q4_1 drafting for the same weights at Q8_0): the metadata is copied field by field, each
quantized tensor is dequantized with ``gguf.quants.dequantize`` and written in the new type; float
tensors (norms) are kept as they are.

    python scripts/requantize_gguf.py SRC.gguf DST.gguf --type q8_0
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from minfer.testing.gguf_writing import copy_fields

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", choices=["q8_0", "f16"], default="q8_0")
    args = ap.parse_args()
    reader = GGUFReader(args.src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    new_type = GGMLQuantizationType.Q8_0 if args.type == "q8_0" else GGMLQuantizationType.F16
    dst = Path(args.dst)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, suffix=".part")
    os.close(fd)
    writer = GGUFWriter(tmp, arch)
    copy_fields(reader, writer)
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]  # numpy order: rows last in GGUF's list
        if t.tensor_type in FLOAT_TYPES:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        values = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if new_type == GGMLQuantizationType.F16:
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            writer.add_tensor(t.name, quantize(values, new_type), raw_dtype=new_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.chmod(tmp, 0o644)
    os.replace(tmp, dst)


if __name__ == "__main__":
    main()
