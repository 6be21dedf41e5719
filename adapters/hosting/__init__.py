"""Hosting engines: engine settings by device, engine-core processes, CPU limits and core sharing, the allocator, merged weights, which model runner."""
