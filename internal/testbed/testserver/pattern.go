package testserver

import (
	"bytes"
	"encoding/binary"
	"io"
)

// patternBlock is the 8-byte block at offset 8*k: splitmix64 of k, little
// endian. It has no short period, unlike a counter.
func patternBlock(k uint64) uint64 {
	z := k*0x9e3779b97f4a7c15 + 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// FillPattern writes into b the bytes of Pattern that start at offset off.
func FillPattern(b []byte, off int64) {
	k := uint64(off) / 8
	skip := int(uint64(off) % 8)
	var blk [8]byte
	for len(b) > 0 {
		binary.LittleEndian.PutUint64(blk[:], patternBlock(k))
		n := copy(b, blk[skip:])
		b = b[n:]
		skip = 0
		k++
	}
}

// Pattern returns a reader of the first n bytes of the pattern.
func Pattern(n int64) io.Reader { return &patternReader{left: n} }

type patternReader struct {
	off, left int64
}

func (p *patternReader) Read(b []byte) (int, error) {
	if p.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(b)) > p.left {
		b = b[:p.left]
	}
	FillPattern(b, p.off)
	p.off += int64(len(b))
	p.left -= int64(len(b))
	return len(b), nil
}

// VerifyPattern reads r to its end and returns how many bytes came and the
// offset of the first byte that differs from Pattern, or -1.
func VerifyPattern(r io.Reader) (n, mismatch int64, err error) {
	mismatch = -1
	buf := make([]byte, 64<<10)
	want := make([]byte, len(buf))
	for {
		m, rerr := r.Read(buf)
		if m > 0 && mismatch < 0 {
			FillPattern(want[:m], n)
			if !bytes.Equal(buf[:m], want[:m]) {
				i := 0
				for buf[i] == want[i] {
					i++
				}
				mismatch = n + int64(i)
			}
		}
		n += int64(m)
		if rerr == io.EOF {
			return n, mismatch, nil
		}
		if rerr != nil {
			return n, mismatch, rerr
		}
	}
}
