"""Shared-memory communicator for ranks on one host (segment, flags, schedules, communicator)."""

from .communicator import ShmCommunicator, ShmOptions, shm_available

__all__ = ["ShmCommunicator", "ShmOptions", "shm_available"]
