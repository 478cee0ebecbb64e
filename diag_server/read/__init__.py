"""What the server answers about a run: queries, chart views, downsampling, the timeline, change streams,
exports. Reads only; it may import rules and store, nothing above them."""
