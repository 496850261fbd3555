"""Guards around every call: admission (rate, concurrency, host) and the audit trail."""

from sandbox_server.guard.admission import Admission, Ticket
from sandbox_server.guard.audit import AuditLog, call_record

__all__ = ["Admission", "AuditLog", "Ticket", "call_record"]
