"""AIRSolver: Asymmetric Input Recurrence for Sudoku and Maze (see README.md beside this file).

Data helpers that share names across tasks (``PAD``, ``split_of``, ...) stay in their modules:
``modeling.air.sudoku_air`` and ``modeling.air.maze_air``.
"""

from __future__ import annotations

from .configuration_air import INJECTION_VARIANTS, INPUT_OPERATORS, LEVEL_TOKENS, AIRConfig
from .maze_air import (
    load_maze_csv,
    maze_dataset,
    maze_dataset_dict,
    parse_maze,
    path_is_valid_and_optimal,
    valid_optimal_accuracy,
)
from .modeling_air import AIRCarry, AIROutput, AIRSolution, AIRSolver
from .optim_air import EMA, AdamATan2, make_scheduler
from .puzzle_folders import PuzzleFolderError, load_puzzle_folder
from .sudoku_air import (
    SudokuSpec,
    load_sudoku_extreme_csv,
    parse_sudoku,
    sudoku_dataset,
    sudoku_vocab_size,
)

__all__ = [
    "EMA",
    "INJECTION_VARIANTS",
    "INPUT_OPERATORS",
    "LEVEL_TOKENS",
    "AIRCarry",
    "AIRConfig",
    "AIROutput",
    "AIRSolution",
    "AIRSolver",
    "AdamATan2",
    "PuzzleFolderError",
    "SudokuSpec",
    "load_maze_csv",
    "load_puzzle_folder",
    "load_sudoku_extreme_csv",
    "make_scheduler",
    "maze_dataset",
    "maze_dataset_dict",
    "parse_maze",
    "parse_sudoku",
    "path_is_valid_and_optimal",
    "sudoku_dataset",
    "sudoku_vocab_size",
    "valid_optimal_accuracy",
]
