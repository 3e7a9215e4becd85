"""The job kinds shipped with localai-tw, exposed as plugins (see ``localai_tw.jobs.builtin``).
Nothing else belongs here: ``twisted.plugin`` collects every module attribute that provides a
plugin interface."""

from localai_tw.jobs.builtin import chat_job, embed_batch_job

__all__ = ["chat_job", "embed_batch_job"]
