"""What a node's uploads reveal to a curious server (label-inference attacks) and what hiding them
would cost."""
