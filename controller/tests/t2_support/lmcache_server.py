"""Runs the real LMCache standalone server (`lmcache/v1/server/__main__.py`, the `lm://` tier)
from an unzipped `lmcache` wheel, without torch or a GPU.

    python3 lmcache_server.py <unzipped-wheel-dir> <host> <port>

Everything the server executes is the wheel's own code: `lmcache/v1/server/` (the socket loop,
the CPU storage backend), `lmcache/v1/protocol.py` (the wire messages), `lmcache/utils.py` (the
`CacheEngineKey` the server parses every request's key into) and `lmcache/logging.py`. Two
imports are replaced:

- `torch`: a stand-in with the dtype objects and `torch.Size` those modules name (the server only
  maps dtypes to integers and back and stores shapes; it never touches a tensor);
- `lmcache.v1.memory_management`: that module pulls in the GPU allocator, so only its
  `MemoryFormat` enum is executed, taken from the wheel's own source (by `ast`), not retyped.

The `lmcache` package's `__init__` (device detection through torch) is not run; the package is a
plain namespace over the wheel directory. `scripts/fetch-lmcache.sh` downloads the wheel.
"""

import ast
import runpy
import sys
import types
from pathlib import Path


def fake_torch() -> types.ModuleType:
    torch = types.ModuleType("torch")

    class dtype:  # noqa: N801 - torch's spelling
        def __init__(self, name):
            self.name = name

        def __repr__(self):
            return f"torch.{self.name}"

    torch.dtype = dtype
    for name in [
        "float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32",
        "int64", "bool", "float8_e4m3fn", "float8_e5m2",
    ]:
        setattr(torch, name, dtype(name))
    # torch's aliases are the same objects.
    torch.half, torch.float, torch.double = torch.float16, torch.float32, torch.float64

    class Size(tuple):
        pass

    class Tensor:
        pass

    torch.Size, torch.Tensor = Size, Tensor
    return torch


def memory_management(wheel: Path) -> types.ModuleType:
    src = (wheel / "lmcache/v1/memory_management.py").read_text()
    tree = ast.parse(src)
    enum = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MemoryFormat"]
    if len(enum) != 1:
        raise SystemExit("MemoryFormat not found in lmcache/v1/memory_management.py")
    mod = types.ModuleType("lmcache.v1.memory_management")
    code = ast.Module(
        body=[ast.parse("from enum import Enum, auto").body[0], enum[0]], type_ignores=[]
    )
    exec(compile(code, str(wheel / "lmcache/v1/memory_management.py"), "exec"), mod.__dict__)
    return mod


def main() -> None:
    wheel, host, port = Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[3]
    sys.modules["torch"] = fake_torch()
    for name in ["lmcache", "lmcache.v1"]:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(wheel / name.replace(".", "/"))]
        sys.modules[name] = pkg
    sys.modules["lmcache.v1.memory_management"] = memory_management(wheel)
    sys.argv = ["lmcache_server", host, port, "cpu"]
    runpy.run_path(str(wheel / "lmcache/v1/server/__main__.py"), run_name="__main__")


if __name__ == "__main__":
    main()
