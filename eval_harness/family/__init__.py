"""Tasks of the project's own model families (AIR Sudoku / Maze, arithmetic splits, ASM language
modelling): the tasks, their plots, their report and their payload schemas."""
