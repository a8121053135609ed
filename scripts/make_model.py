#!/usr/bin/env python3
"""Write the standard weight-less DeepSeek-V3 model folders (dsv3-4l, dsv3-ep16-slice); see sglang_h20.models."""
from sglang_h20.models import main

if __name__ == "__main__":
    main()
