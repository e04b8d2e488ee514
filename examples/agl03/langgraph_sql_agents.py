"""An Agent Lightning 0.3 program in the shape of its own ``examples/spider``: a LangGraph ``LitAgent`` of several
agents (a query writer, a checker, a rewriter) over a SQLite database, of which only the writers train
(``Trainer(adapter={"agent_match": ...})``), written for ``agl.VERL`` and a GPU cluster (``rollout.name: vllm``).

    make venv-agl03
    .venv-agl03/bin/aglverl fit --rollout embedded examples/agl03/langgraph_sql_agents.py fast --active-agent write
    .venv-agl03/bin/aglverl fit examples/agl03/langgraph_sql_agents.py qwen --active-agent write   # with GPUs

``aglverl fit`` runs the file unchanged with ``agl.VERL`` resolving to aglverl's ``VERL``; ``--rollout embedded``
trains with aglverl's CPU engine in place of the vLLM the config names (on this machine: the built-in tiny model,
random weights, so the queries are nonsense and the reward stays near 0; the ``fast`` config is the one Agent
Lightning's own CI runs, 2 steps). Each rollout's graph is ``write_query -> execute_query -> check_query ->
(rewrite_query -> execute_query -> check_query)*``; its nodes are the agents: Agent Lightning's tracer names each
LLM call's agent after the LangGraph node around it, and ``--active-agent write`` (a regular expression) trains the
calls of ``write_query`` and ``rewrite_query`` only. The checker's calls are made and recorded, not trained: the
last line counts both. The data (a small shop database and questions with their SQL) is made at start.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sqlite3
import tempfile
from copy import deepcopy
from pathlib import Path
from typing import Any, Literal

import agentlightning as agl
from langchain_core.messages import BaseMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

WRITE_PROMPT = ChatPromptTemplate(
    [
        (
            "system",
            "You write one SQLite query that answers the question.\nTables:\n{schema}\nAnswer as ```sql\nQUERY\n```",
        ),
        ("user", "Question: {question}"),
    ]
)
CHECK_PROMPT = ChatPromptTemplate(
    [
        (
            "system",
            "You check a SQLite query against its question and its result.\nTables:\n{schema}\n"
            "End with THE QUERY IS CORRECT. or THE QUERY IS INCORRECT.",
        ),
        ("user", "Question: {question}\nQuery: {query}\nResult: {execution}"),
    ]
)
REWRITE_PROMPT = ChatPromptTemplate(
    [
        (
            "system",
            "You rewrite a SQLite query to fix what the review found.\nTables:\n{schema}\nAnswer as ```sql\nQUERY\n```",
        ),
        ("user", "Question: {question}\nQuery: {query}\nResult: {execution}\nReview: {feedback}"),
    ]
)

TABLES = {
    "products": "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, price REAL, stock INTEGER)",
    "orders": "CREATE TABLE orders (id INTEGER PRIMARY KEY, product_id INTEGER, quantity INTEGER)",
}


def make_database(path: Path, seed: int = 0) -> None:
    """A shop: 12 products and 30 orders."""
    rng = random.Random(seed)
    with sqlite3.connect(path) as db:
        for create in TABLES.values():
            db.execute(create)
        names = ["pen", "ink", "pad", "cap", "mug", "bag", "box", "cup", "jar", "map", "kit", "fan"]
        db.executemany(
            "INSERT INTO products VALUES (?, ?, ?, ?)",
            [(i + 1, n, rng.randint(1, 20), rng.randint(0, 50)) for i, n in enumerate(names)],
        )
        db.executemany(
            "INSERT INTO orders VALUES (?, ?, ?)",
            [(i + 1, rng.randint(1, 12), rng.randint(1, 5)) for i in range(30)],
        )


def make_questions(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Questions with the SQL that answers them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        price, stock = rng.randint(2, 18), rng.randint(5, 45)
        rows.append(
            rng.choice(
                [
                    {
                        "question": f"How many products cost more than {price}?",
                        "query": f"SELECT COUNT(*) FROM products WHERE price > {price}",
                    },
                    {
                        "question": f"Which products have fewer than {stock} in stock?",
                        "query": f"SELECT name FROM products WHERE stock < {stock}",
                    },
                    {
                        "question": "How many units of each product were ordered?",
                        "query": "SELECT product_id, SUM(quantity) FROM orders GROUP BY product_id",
                    },
                ]
            )
        )
    return rows


def run_sql(db_path: str, query: str) -> tuple[list[Any] | None, str]:
    """The query's rows (``None`` if it fails) and its result as text, on a read-only connection."""
    try:
        with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
            rows = db.execute(query).fetchmany(20)
        return rows, repr(rows)
    except sqlite3.Error as exc:
        return None, f"Error: {exc}"


def parse_query(text: str) -> str:
    found = re.findall(r"```\w*\n(.*?)\n```", text, re.DOTALL)
    return found[-1].strip() if found else text.strip()


class State(TypedDict, total=False):
    question: str
    query: str
    execution: str
    feedback: str
    turns: int


class SQLAgent:
    """The graph: the writer's query is run, checked, and rewritten until the checker is satisfied or
    ``max_turns`` queries were written."""

    def __init__(self, db_path: str, llm: ChatOpenAI, max_turns: int) -> None:
        self.db_path, self.llm, self.max_turns = db_path, llm, max_turns
        self.schema = "\n".join(TABLES.values())

    def _ask(self, prompt: ChatPromptTemplate, **fields: Any) -> str:
        reply: BaseMessage = self.llm.invoke(prompt.invoke({"schema": self.schema, **fields}))
        return str(reply.content)

    def write_query(self, state: State) -> State:
        query = parse_query(self._ask(WRITE_PROMPT, question=state["question"]))
        return {"query": query, "turns": 1}

    def execute_query(self, state: State) -> State:
        return {"execution": run_sql(self.db_path, state["query"])[1][:500]}

    def check_query(self, state: State) -> State:
        return {"feedback": self._ask(CHECK_PROMPT, **_fields(state))}

    def rewrite_query(self, state: State) -> State:
        query = parse_query(self._ask(REWRITE_PROMPT, feedback=state["feedback"], **_fields(state)))
        return {"query": query or state["query"], "turns": state["turns"] + 1}

    def route(self, state: State) -> Literal["rewrite_query", "__end__"]:
        verdict = state["feedback"]
        if verdict.rfind("THE QUERY IS CORRECT") > verdict.rfind("THE QUERY IS INCORRECT"):
            return END
        return END if state["turns"] >= self.max_turns else "rewrite_query"

    def graph(self) -> Any:
        builder = StateGraph(State)
        for node in (self.write_query, self.execute_query, self.check_query, self.rewrite_query):
            builder.add_node(node.__name__, node)
        builder.add_edge(START, "write_query")
        builder.add_edge("write_query", "execute_query")
        builder.add_edge("execute_query", "check_query")
        builder.add_conditional_edges("check_query", self.route)
        builder.add_edge("rewrite_query", "execute_query")
        return builder.compile()


def _fields(state: State) -> dict[str, str]:
    return {"question": state["question"], "query": state["query"], "execution": state["execution"]}


class LitSQLAgent(agl.LitAgent[dict[str, Any]]):
    """Agent Lightning's view of the agent: one rollout is one question, rewarded 1.0 when the final query's
    result is the reference query's."""

    def __init__(self, db_path: str, max_turns: int = 2) -> None:
        super().__init__()
        self.db_path, self.max_turns = db_path, max_turns

    def rollout(self, task: dict[str, Any], resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        llm = resources["main_llm"]
        assert isinstance(llm, agl.LLM) and isinstance(rollout, agl.AttemptedRollout)
        settings = {"model": llm.model, **llm.sampling_parameters}  # as spider passes them on
        chat = ChatOpenAI(
            model=settings["model"],
            base_url=llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id),
            api_key=os.environ.get("OPENAI_API_KEY", llm.api_key or "dummy"),
            temperature=settings.get("temperature", 1.0),
            max_tokens=settings.get("max_tokens"),
            max_retries=0,
        )
        graph = SQLAgent(self.db_path, chat, self.max_turns).graph()
        final = graph.invoke(
            {"question": task["question"]},
            {"callbacks": [self.tracer.get_langchain_callback_handler()], "recursion_limit": 50},
        )
        got, _ = run_sql(self.db_path, final["query"])
        want, _ = run_sql(self.db_path, task["query"])
        return 1.0 if got is not None and sorted(map(repr, got)) == sorted(map(repr, want or [])) else 0.0


CONFIG: dict[str, Any] = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {
        "train_batch_size": 32,
        "max_prompt_length": 4096,
        "max_response_length": 2048,
        "truncation": "error",
    },
    "actor_rollout_ref": {
        "rollout": {
            "name": "vllm",
            "n": 4,
            "tensor_model_parallel_size": 1,
            "gpu_memory_utilization": 0.8,
            "multi_turn": {"format": "hermes"},
            "log_prob_micro_batch_size_per_gpu": 4,
        },
        "actor": {
            "ppo_mini_batch_size": 32,
            "ppo_micro_batch_size_per_gpu": 4,
            "optim": {"lr": 1e-6},
            "use_kl_loss": False,
            "entropy_coeff": 0,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.3,
        },
        "model": {"path": "Qwen/Qwen2.5-Coder-1.5B-Instruct", "use_remove_padding": True},
    },
    "trainer": {
        "n_gpus_per_node": 1,
        "val_before_train": True,
        "logger": ["console"],
        "project_name": "AgentLightning",
        "experiment_name": "langgraph_sql_agents",
        "test_freq": 32,
        "total_epochs": 2,
        "save_freq": -1,
    },
}


def config_fast() -> dict[str, Any]:
    """Agent Lightning's CI configuration, fitted to a CPU and the built-in tiny model: 2 steps of 2 questions x 2
    rollouts, short answers."""
    config = deepcopy(CONFIG)
    config["data"].update(train_batch_size=2, max_prompt_length=512, max_response_length=16)
    config["actor_rollout_ref"]["rollout"].update(n=2, log_prob_micro_batch_size_per_gpu=2)
    config["actor_rollout_ref"]["actor"].update(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2)
    config["actor_rollout_ref"]["actor"]["optim"]["lr"] = 1e-3
    config["actor_rollout_ref"]["model"] = {"path": "tiny"}
    config["trainer"].update(val_before_train=False, test_freq=-1, total_training_steps=2)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", choices=["fast", "qwen"])
    parser.add_argument(
        "--active-agent", default=None, help="agent_match: a regular expression of agent names"
    )
    parser.add_argument("--runners", type=int, default=2)
    args = parser.parse_args()

    config = config_fast() if args.config == "fast" else deepcopy(CONFIG)
    questions = make_questions(64)
    algorithm = agl.VERL(config)
    trainer = agl.Trainer(
        n_runners=args.runners, algorithm=algorithm, adapter={"agent_match": args.active_agent}
    )
    print("Adapter agent match acknowledged:", trainer.adapter.agent_match)  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory(prefix="sql-agents-") as data_dir:  # the shop's database, for this run
        db_path = Path(data_dir) / "shop.sqlite"
        make_database(db_path)
        trainer.fit(LitSQLAgent(str(db_path)), train_dataset=questions[:56], val_dataset=questions[56:])
    metrics = getattr(algorithm, "metrics", {})  # aglverl's VERL keeps the last step's metrics
    print(
        f"final training reward: {metrics.get('training/reward', float('nan')):.3f}, calls trained: "
        f"{metrics.get('batch/n_calls', 0):.0f}, calls of other agents: {metrics.get('batch/n_calls_unselected', 0):.0f}"
    )


if __name__ == "__main__":
    main()
