"""Writes ``allreduce_param/ml_params.py``: the Estimators' Params of the fit's settings,
declared in class bodies (one class per Param, as pyspark's own ``pyspark.ml.param.shared``)
so that IDEs, ``help()`` and documentation tools see them.

A developer's tool: after adding or changing a setting (``train.settings``), run
``python -m allreduce_param._params_source``. ``tests/test_settings.py`` checks that the
file is what this writes. Nothing imports this module at run time.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from allreduce_param.train.settings import ParamSpec, estimator_params

#: Where the generated module goes.
TARGET = Path(__file__).with_name("ml_params.py")

#: The Python type a Param of each kind holds (``ParamSpec.kind``).
_TYPES = {"Int": "int", "Float": "float", "String": "str", "Boolean": "bool", "identity": "Any"}

_HEAD = '''"""The pyspark.ml Params of the fit's settings (``FitSettings``): one class per Param with its
getter, ``FitSettingParams`` all of them, ``FitSettingSetters`` their setters.

Written by ``python -m allreduce_param._params_source`` from ``train.settings``: do not edit
by hand (``tests/test_settings.py`` checks that it is current).
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters'''


def _title(name: str) -> str:
    return name[0].upper() + name[1:]


def _quoted(text: str) -> str:
    """``text`` as a double-quoted string literal, as the formatter writes one."""
    return json.dumps(text, ensure_ascii=False)


def _string(text: str, indent: int) -> str:
    """``text`` as a Python string literal laid out as the formatter keeps it: one line, or
    pieces on lines of their own at ``indent``."""
    if indent + len(_quoted(text)) + 1 <= 100:  # and a comma
        return " " * indent + _quoted(text)
    pieces = textwrap.wrap(text, 84 - indent, drop_whitespace=False, break_on_hyphens=False)
    return "\n".join(" " * indent + _quoted(piece) for piece in pieces)


def _docstring(text: str, indent: int) -> str:
    """A docstring of ``text``, wrapped within the line length."""
    lines = textwrap.wrap(text, 92 - indent, break_on_hyphens=False)
    body = f"\n{' ' * indent}".join(lines)
    if len(lines) > 1:
        body += f"\n{' ' * indent}"
    return f'{" " * indent}"""{body}"""'


def _kind(spec: ParamSpec) -> str:
    """The type a getter of ``spec`` returns."""
    kind = _TYPES[spec.kind]
    return kind if spec.default is not None or kind == "Any" else f"{kind} | None"


def _sentence(text: str) -> str:
    """``text`` ending in a full stop."""
    return text if text.endswith(".") else text + "."


def _param_class(spec: ParamSpec) -> str:
    converter = "identity" if spec.kind == "identity" else f"to{spec.kind}"
    return "\n".join(
        [
            f"class Has{_title(spec.name)}(Params):",
            _docstring(f"The fit setting {spec.setting} as the Param {spec.name}.", 4),
            "",
            f"    {spec.name} = Param(",
            "        Params._dummy(),",
            f"        {_quoted(spec.name)},",
            _string(spec.doc, 8) + ",",
            f"        typeConverter=TypeConverters.{converter},",
            "    )",
            "",
            f"    def get{_title(spec.name)}(self) -> {_kind(spec)}:",
            _docstring(_sentence(f"The value of {spec.name}: {spec.doc}"), 8),
            f"        return self.getOrDefault(self.{spec.name})",
        ]
    )


def _setter(spec: ParamSpec) -> str:
    return "\n".join(
        [
            f"    def set{_title(spec.name)}(self, value: {_kind(spec)}) -> Any:",
            _docstring(_sentence(f"Set {spec.name}: {spec.doc}"), 8),
            f"        return self._set({spec.name}=value)",
        ]
    )


def source() -> str:
    """The text of ``ml_params.py``, from the settings as they are."""
    specs = list(estimator_params())
    bases = "".join(f"    Has{_title(spec.name)},\n" for spec in specs)
    parts = [_HEAD, *(_param_class(spec) for spec in specs)]
    parts.append(
        f"class FitSettingParams(\n{bases}):\n"
        '    """Every fit setting\'s Param and its getter: the Estimators and their Models have '
        'them."""'
    )
    parts.append(
        "class FitSettingSetters(Params):\n"
        '    """Every fit setting\'s setter: the Estimators have them."""\n\n'
        + "\n\n".join(_setter(spec) for spec in specs)
    )
    return "\n\n\n".join(parts) + "\n"


def main() -> int:
    """Write ``TARGET``; say whether it changed."""
    text = source()
    old = TARGET.read_text() if TARGET.exists() else None
    if old == text:
        print(f"{TARGET} is current")
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
