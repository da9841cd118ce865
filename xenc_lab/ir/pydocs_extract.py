"""Prints, as JSON, the documented functions of the standard-library modules named on the command line: one
``[module, name, docstring]`` per function. ``xenc_lab.ir.pydocs`` runs it in a fresh, isolated interpreter
(``python -I``), so that what the calling process has patched (pytest's ``threading.excepthook``, a notebook
kernel's hooks) cannot change the collection. It imports nothing but the standard library."""
import importlib
import inspect
import json
import sys


def documented_functions(module_name: str):
    module = importlib.import_module(module_name)
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        doc = inspect.getdoc(obj) or ""
        if len(doc) >= 80 and len(name) >= 4:
            yield [module_name, name, doc]


if __name__ == "__main__":
    json.dump([f for module in sys.argv[1:] for f in documented_functions(module)], sys.stdout)
