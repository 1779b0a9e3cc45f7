"""What a run needs around its step: joining processes and their rows, launching them, the hang
watchdog, stop signals, start-up checks, and the data that feeds the step."""
