"""Pure building blocks shared by the server and the clients (no Flower imports)."""
