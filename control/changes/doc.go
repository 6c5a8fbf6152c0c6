// Package changes tracks object changes between syncs the way kube-proxy
// does. Every informer event (add, update, delete) becomes one
// (previous, current) pair for its object: the first event since the last
// sync fixes previous, later events only move current. A change that ends
// where it began (an update that is undone, an add followed by a delete, an
// update that touches nothing the model uses) is dropped, so the pending
// count goes back down and a sync is not needed for it. Update also says
// whether the event itself changed anything, which is what kube-proxy asks
// of an EndpointSlice event before it queues a sync.
//
// Values are the converted form of an object (what the model uses), not
// the API object, so a change to an unused field is no change at all. The
// zero value of V means "absent".
//
// A Tracker is safe for concurrent use: informer handlers call Update, the
// sync loop calls Checkout.
package changes
