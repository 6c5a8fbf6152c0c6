// Package search finds a forwarding path's zero-loss throughput the way
// RFC 2544 (section 26.1) does: offer a rate for a fixed time, count what
// arrives, and bisect the offered rate until the highest rate whose loss is
// within the tolerance is known to the requested resolution. It also walks
// a list of offered rates for a loss-versus-load curve.
//
// The package only decides which rate to try next; the caller's Trial does
// the sending and counting, so the logic is tested without a network.
package search
