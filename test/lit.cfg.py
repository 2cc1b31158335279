# lit configuration for nnscaler's FileCheck tests. Run through `cargo test` (tools/tests/lit.rs),
# which puts the freshly built nnscaler-opt and nnscaler first on PATH.
import os
import lit.formats

config.name = "nnscaler"
config.test_format = lit.formats.ShTest(True)
config.suffixes = [".mlir", ".test"]
config.test_source_root = os.path.dirname(__file__)
# Where each test's Output/ goes: next to the tests (ignored by git), or under
# `--param out=DIR`.
config.test_exec_root = lit_config.params.get("out", config.test_source_root)
config.environment["PATH"] = os.environ["PATH"]
# Tests must leave the tree clean: no __pycache__ next to test/oracle/*.py.
config.environment["PYTHONDONTWRITEBYTECODE"] = "1"
config.excludes = ["lit.cfg.py", "Inputs"]
llvm_bin = "/usr/lib/llvm-19/bin"
config.substitutions.append(("FileCheck", os.path.join(llvm_bin, "FileCheck")))
config.substitutions.append(("%not", os.path.join(llvm_bin, "not")))
config.substitutions.append(("mlir-opt", "mlir-opt-19"))
# A Python with numpy (Debian's python3-numpy), for tests that write safetensors inputs.
config.substitutions.append(("%python", os.environ.get("NNSCALER_PYTHON", "/usr/bin/python3")))
config.substitutions.append(("%oracle", os.path.join(config.test_source_root, "oracle")))
# torchrun's stand-in: N processes with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
config.substitutions.append(
    ("%launch", os.environ.get("NNSCALER_PYTHON", "/usr/bin/python3") + " "
     + os.path.join(os.path.dirname(config.test_source_root), "scripts", "launch-local.py")))
