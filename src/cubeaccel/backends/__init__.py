"""How a class of device is prepared, attached and cleaned."""
