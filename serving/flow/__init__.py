"""Streams across the stub processes, through files in the run's private folder (the side channel): cancelled and lost marks, the live-stream board, the admission gate and the generator's slots."""
