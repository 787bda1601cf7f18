"""jobs/pipeline.ipynb runs top to bottom in a real Jupyter kernel, so it never rots."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.slow, pytest.mark.spark]

NOTEBOOK = Path(__file__).resolve().parent.parent / "jobs" / "pipeline.ipynb"
#: What the test puts after the notebook's "parameters" cell (as papermill would): the
#: pipeline's fit trains EPOCHS epochs instead of a user's 10, each fit of the
#: cross-validation TUNING_EPOCHS; every cell still runs, and what is checked is the same.
EPOCHS, TUNING_EPOCHS = 4, 1


def with_parameters(notebook, **values) -> None:
    """Put a cell setting ``values`` right after ``notebook``'s cell tagged "parameters"."""
    (where,) = [
        i
        for i, cell in enumerate(notebook.cells)
        if "parameters" in cell.get("metadata", {}).get("tags", [])
    ]
    source = "\n".join(f"{name} = {value!r}" for name, value in values.items())
    notebook.cells.insert(where + 1, nbformat.v4.new_code_cell(source))


def test_the_pipeline_notebook_runs_top_to_bottom(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    with_parameters(notebook, epochs=EPOCHS, tuning_epochs=TUNING_EPOCHS)
    # a cell that raises makes execute() raise CellExecutionError, naming the cell
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    outputs = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    ]
    text = "".join(output.get("text", "") for output in outputs if output.output_type == "stream")
    accuracy = float(re.search(r"^test accuracy (\S+)$", text, re.M).group(1))
    assert accuracy > 0.9
    assert any("image/png" in output.get("data", {}) for output in outputs), (
        "the loss curve was not drawn"
    )
    assert re.search(r"^best stepSize 0\.005$", text, re.M)
    reloaded = re.search(r"^reloaded test accuracy (\S+)$", text, re.M).group(1)
    assert reloaded == re.search(r"^best model test accuracy (\S+)$", text, re.M).group(1)
    # the live bar drew as a notebook widget
    assert any(
        "application/vnd.jupyter.widget-view+json" in output.get("data", {}) for output in outputs
    )
