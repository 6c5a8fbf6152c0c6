package sink

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
)

// Counts are what a sink has seen since it was attached.
type Counts struct {
	Packets uint64
	Bytes   uint64
}

// Sub returns c - o, for the counts of one interval.
func (c Counts) Sub(o Counts) Counts { return Counts{c.Packets - o.Packets, c.Bytes - o.Bytes} }

// Sink is an attached counting program.
type Sink struct {
	prog  *ebpf.Program
	stats *ebpf.Map
	link  link.Link
}

// Mode chooses native (driver) or generic XDP.
type Mode int

const (
	Native Mode = iota
	Generic
)

// Attach loads the counter and attaches it to ifindex in the calling
// thread's namespace. On veth use Native: it is what makes the veth take
// redirected frames and creates its NAPI instance.
func Attach(ifindex int, mode Mode) (*Sink, error) {
	stats, err := ebpf.NewMap(&ebpf.MapSpec{Name: "sink_stats", Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: 16, MaxEntries: 1})
	if err != nil {
		return nil, fmt.Errorf("sink: stats map: %w", err)
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "sink_count", Type: ebpf.XDP, License: "GPL", Instructions: program(stats.FD())})
	if err != nil {
		stats.Close()
		return nil, fmt.Errorf("sink: loading the program: %w", err)
	}
	flags := link.XDPDriverMode
	if mode == Generic {
		flags = link.XDPGenericMode
	}
	l, err := link.AttachXDP(link.XDPOptions{Program: prog, Interface: ifindex, Flags: flags})
	if err != nil {
		prog.Close()
		stats.Close()
		return nil, fmt.Errorf("sink: attaching to ifindex %d: %w", ifindex, err)
	}
	return &Sink{prog: prog, stats: stats, link: l}, nil
}

// XDP return codes.
const (
	xdpDrop = 1
	xdpPass = 2
)

// program: if the frame is IPv4, add one packet and its length to the
// per-CPU counters and drop it; otherwise pass it.
func program(statsFD int) asm.Instructions {
	return asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R2, asm.R6, 0, asm.Word), // data
		asm.LoadMem(asm.R3, asm.R6, 4, asm.Word), // data_end
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, 14),
		asm.JGT.Reg(asm.R4, asm.R3, "pass"),
		asm.LoadMem(asm.R4, asm.R2, 12, asm.Half),
		asm.JNE.Imm(asm.R4, 0x0008, "pass"), // ETH_P_IP as loaded on little endian
		asm.Mov.Reg(asm.R7, asm.R3),
		asm.Sub.Reg(asm.R7, asm.R2),
		asm.StoreImm(asm.RFP, -4, 0, asm.Word),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.LoadMapPtr(asm.R1, statsFD),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "drop"),
		asm.LoadMem(asm.R1, asm.R0, 0, asm.DWord),
		asm.Add.Imm(asm.R1, 1),
		asm.StoreMem(asm.R0, 0, asm.R1, asm.DWord),
		asm.LoadMem(asm.R1, asm.R0, 8, asm.DWord),
		asm.Add.Reg(asm.R1, asm.R7),
		asm.StoreMem(asm.R0, 8, asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R0, xdpDrop).WithSymbol("drop"),
		asm.Return(),
		asm.Mov.Imm(asm.R0, xdpPass).WithSymbol("pass"),
		asm.Return(),
	}
}

// Read returns the counts summed over CPUs.
func (s *Sink) Read() (Counts, error) {
	var per []struct{ Packets, Bytes uint64 }
	if err := s.stats.Lookup(uint32(0), &per); err != nil {
		return Counts{}, fmt.Errorf("sink: reading counters: %w", err)
	}
	var c Counts
	for _, v := range per {
		c.Packets += v.Packets
		c.Bytes += v.Bytes
	}
	return c, nil
}

// Close detaches the program.
func (s *Sink) Close() error {
	return errors.Join(s.link.Close(), s.prog.Close(), s.stats.Close())
}
