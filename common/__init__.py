"""What both sides share, without Flower: pure functions on arrays, grouped by concern below."""
