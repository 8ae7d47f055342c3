"""HTTP layer of the serving loop: thin routers over the serving classes."""
