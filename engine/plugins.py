"""The user's code, named on the command line as FILE.py:NAME (a path) or module:NAME (an
importable module): --model, --dataset FILE.py:NAME. Loading it and calling it never ends in
a traceback of ours: a missing file or name, and an exception raised inside the user's code,
are each one line, the last naming the line of their file it came from.
"""

import difflib
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from inspect import ismodule
from pathlib import Path

from engine.errors import UserError

def is_file(source):
    """Whether the part before NAME is a file (my_net.py, nets/my_net.py) or a module (my_net)."""
    return source.endswith(".py") or "/" in source or os.sep in source


def plugin_key(ref):
    """What identifies --model or --dataset across runs: my_net.py:Net, ./my_net.py:Net and
    my_net:Net are one (a checkpoint may move between folders and machines)."""
    source, _, name = ref.rpartition(":")
    return f"{Path(source).stem if is_file(source) else source}:{name}"


def load_plugin(ref, flag):
    """The object NAME of FILE.py:NAME (a path) or module:NAME (importable)."""
    source, _, name = ref.rpartition(":")
    if is_file(source):
        module = import_file(Path(source).expanduser(), flag, ref)
    else:
        try:
            module = importlib.import_module(source)
        except ModuleNotFoundError as err:
            if err.name != source.split(".")[0] and err.name != source:
                raise user_error(err, f"{flag} {ref}: importing {source}", None) from None
            if Path(source).is_dir():
                raise not_a_file(Path(source), flag, ref) from None
            hint = ("one colon: FILE.py:NAME or module:NAME" if ".py:" in source else
                    f"for a file give its path: {source}.py:{name}")
            raise UserError(f"{flag} {ref}: no module named {source} ({hint})") from None
        except Exception as err:
            raise user_error(err, f"{flag} {ref}: importing {source}", None) from None
        if getattr(module, "__file__", None) is None and hasattr(module, "__path__"):
            # A folder without __init__.py on sys.path imports as a namespace package: no code, so no NAME in it.
            raise not_a_file(Path(next(iter(module.__path__))), flag, ref)
    try:
        return getattr(module, name)
    except AttributeError:
        # What NAME can be: torchvision.models' submodules (resnet, vgg) are no model.
        public = sorted(n for n, value in vars(module).items() if not n.startswith("_") and not ismodule(value))
        close = difflib.get_close_matches(name, public, n=3)
        shown = ", ".join(public[:12]) + (", ..." if len(public) > 12 else "")
        hint = (f"did you mean {' or '.join(close)}?" if close else f"it defines: {shown or 'nothing'}")
        raise UserError(f"{flag} {ref}: {getattr(module, '__file__', None) or source} has no {name} ({hint})") from None


def import_file(path, flag, ref):
    """Import a Python file as the module of its stem (so that DataLoader workers and
    torch.compile find its classes again); its folder joins sys.path for its own imports."""
    source, _, name = ref.rpartition(":")
    if path.is_dir():
        raise not_a_file(path, flag, ref)
    if not path.is_file():
        typed = f"; did you mean {flag} {source}.py:{name}?" if path.with_name(path.name + ".py").is_file() else ""
        raise UserError(f"{flag} {ref}: no such file {path.absolute()}{typed}")
    path = path.resolve()
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
        return loaded
    if loaded is not None:  # another module of that name is imported already: keep both
        name = f"{name}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise user_error(err, f"{flag} {ref}: importing {path.name}", path) from None
    return module


def not_a_file(folder, flag, ref):
    """The one line for FOLDER:NAME, a folder (the user's images, say) named in place of a file."""
    source, _, name = ref.rpartition(":")
    return UserError(f"{flag} {ref}: {folder.absolute()} is a folder, not a Python file or module; name the file "
                     f"that defines {name}: {source.rstrip('/')}/FILE.py:{name}")


def call_user_code(call, what, ref):
    """``call()``, with an exception from the user's code turned into one line that names
    where in their file it was raised."""
    try:
        return call()
    except UserError:
        raise
    except Exception as err:
        raise user_error(err, what, plugin_file(ref)) from None


def own_file(ref):
    """The absolute path of FILE.py in FILE.py:NAME, as a string; None for module:NAME (found
    by its import name wherever it runs)."""
    source = ref.rpartition(":")[0]
    return str(Path(source).expanduser().resolve()) if is_file(source) else None


def plugin_file(ref):
    """The file FILE.py:NAME or module:NAME lives in, or None."""
    source = ref.rpartition(":")[0]
    if is_file(source):
        return Path(source).expanduser().resolve()
    module = sys.modules.get(source)
    return Path(module.__file__).resolve() if getattr(module, "__file__", None) else None


def user_error(err, what, path):
    """One line: what failed, the exception, and the innermost line of the user's file (or
    of any file, when the user's is unknown) in its traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    if isinstance(err, SyntaxError) and err.filename:
        frames.append(traceback.FrameSummary(err.filename, err.lineno or 0, "<module>", line=err.text or ""))
    message = " ".join(str(err).split())
    return UserError(f"{what} raised {type(err).__name__}{f': {message}' if message else ''}"
                     f"{raised_at(err, path, frames)}")


def raised_at(err, path, frames=None, any_file=True):
    """' (at FILE, line N, in NAME: CODE)': the innermost line of ``path`` (of any file, when
    ``path`` is None or, with ``any_file``, not in it) in the traceback of ``err`` (or
    ``frames``); '' for none."""
    frames = traceback.extract_tb(err.__traceback__) if frames is None else frames
    path = None if path is None else Path(path).resolve()
    mine = [f for f in frames if path is None or Path(f.filename).resolve() == path]
    mine = mine or (frames[-1:] if any_file else [])
    if not mine:
        return ""
    frame = mine[-1]
    code = f": {frame.line.strip()}" if frame.line and frame.line.strip() else ""
    return f" (at {frame.filename}, line {frame.lineno}, in {frame.name}{code})"


