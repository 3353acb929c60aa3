"""AIRSolver: Asymmetric Input Recurrence for Sudoku and Maze (see README.md beside this file)."""
