"""Stage 0: the timeline, timing and counter passes (child process only; imports torch)."""
