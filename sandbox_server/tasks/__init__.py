"""Tasks: calls that outlive their request, kept on disk until their time to live has passed."""
