"""`pipeline tune`: sweep batch size per length bucket and choose one."""
