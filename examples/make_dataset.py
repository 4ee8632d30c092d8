"""Write a small synthetic image dataset for the examples: python examples/make_dataset.py data.h5

Each sample is one row of the HDF5 dataset ``samples`` (uint8): a label byte, then a 3 x 32 x 32
image whose colour and stripes depend on the label. Use your own data the same way: any HDF5 file
with one sample per row of a dataset, or a directory of sample files.
"""

import argparse

from hpcstagger.demo.data import make_dataset

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="HDF5 file to write")
    p.add_argument("--samples", type=int, default=2048, help="number of samples (default 2048)")
    p.add_argument("--size", type=int, default=32, help="image height and width (default 32)")
    args = p.parse_args()
    row = make_dataset(args.path, args.samples, (3, args.size, args.size))
    print(f"wrote {args.path}: {args.samples} samples of {row} bytes")
